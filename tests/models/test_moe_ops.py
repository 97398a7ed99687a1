"""The MoE math against numpy: the router's choices (ties included) and the grouped expert MLP
(CPU tiles and ragged_dot) against every expert computed on every token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.models.moe_ops import (
    combine, grouped_mlp, grouped_mlp_ragged, grouped_mlp_tiled, route, sort_by_expert, tile_rows)


def _np_route(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Reference: softmax in float64, a stable sort (ties to the lower expert id), top k."""
    z = np.exp(logits - logits.max(-1, keepdims=True))
    probs = z / z.sum(-1, keepdims=True)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, -1)
    if renormalize:
        w = w / w.sum(-1, keepdims=True)
    return w, ids


def test_router_choices_match_numpy_where_tokens_tie():
    rng = np.random.default_rng(0)
    E = 7
    logits = rng.normal(size=(8, E)).astype(np.float32)
    logits[0] = 0.5  # every expert ties
    logits[1, [1, 4, 6]] = 3.0  # a three-way tie at the top
    logits[2, [0, 2]] = [2.0, 1.0]
    logits[2, [3, 5]] = 1.5  # a tie across the top-k boundary (k=3): 3 wins over 5
    logits[3, :] = -1e4
    logits[3, 6] = 0.0  # one expert takes all the mass
    logits[4] = logits[5]  # two tokens routed identically
    for k in (1, 3, E):
        for renormalize in (False, True):
            w, ids = jax.jit(route, static_argnums=(1, 2))(jnp.asarray(logits), k, renormalize)
            w_ref, ids_ref = _np_route(logits.astype(np.float64), k, renormalize)
            np.testing.assert_array_equal(np.asarray(ids), ids_ref, err_msg=f"k={k}")
            np.testing.assert_allclose(np.asarray(w), w_ref, atol=1e-6, err_msg=f"k={k}")
    _, ids = route(jnp.asarray(logits), 3, True)
    assert np.asarray(ids)[0].tolist() == [0, 1, 2] and np.asarray(ids)[1].tolist() == [1, 4, 6]
    assert np.asarray(ids)[2].tolist() == [0, 3, 5]


def _dense_reference(x, ids, weights, w_gate_up, w_down):
    """Every expert on every token, then each token's top-k mixed (numpy, float64)."""
    gu = np.einsum("th,ehgi->etgi", x, w_gate_up)
    h = gu[..., 0, :] / (1 + np.exp(-gu[..., 0, :])) * gu[..., 1, :]
    y = np.einsum("eti,eih->eth", h, w_down)  # [E, T, H]
    T = x.shape[0]
    return np.stack([sum(weights[t, j] * y[ids[t, j], t] for j in range(ids.shape[1])) for t in range(T)])


@pytest.mark.parametrize("E,k,T,num_shards", [(5, 3, 13, 1), (8, 2, 9, 4)])
def test_grouped_mlp_matches_every_expert_on_every_token(E, k, T, num_shards):
    rng = np.random.default_rng(E * 100 + T)
    H, I = 16, 12
    x = rng.normal(size=(T, H)).astype(np.float32)
    w_gate_up = (0.3 * rng.normal(size=(E, H, 2, I))).astype(np.float32)
    w_down = (0.3 * rng.normal(size=(E, I, H))).astype(np.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(T, E)) * 3, jnp.float32), k, True)
    if E == 8:
        ids = jnp.minimum(ids, 5)  # experts 6, 7 get no rows; ids repeat within a token
    ref = _dense_reference(x.astype(np.float64), np.asarray(ids), np.asarray(weights, np.float64),
                           w_gate_up.astype(np.float64), w_down.astype(np.float64))
    El = E // num_shards
    # On CPU "per platform" runs the tiles at their default size.
    impls = {"ragged_dot": grouped_mlp_ragged, "tiles of 4": functools.partial(grouped_mlp_tiled, tile=4),
             "per platform": grouped_mlp}

    @functools.partial(jax.jit, static_argnums=0)
    def moe(impl, x, ids, weights, w_gate_up, w_down):
        order, es = sort_by_expert(ids)
        xs = x[order // k]
        # Expert parallel: each shard computes its own experts' rows; the shards sum to the whole.
        ys = sum(impl(xs, es, w_gate_up[s * El:(s + 1) * El], w_down[s * El:(s + 1) * El], jnp.int32(s * El),
                      jax.nn.silu) for s in range(num_shards))
        return combine(ys, order, weights)

    for name, impl in impls.items():
        got = np.asarray(moe(impl, x, ids, weights, w_gate_up, w_down))
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5, err_msg=name)


def test_tile_rows_follows_the_mean_group():
    assert tile_rows(128, 64) == 4 and tile_rows(128, 8) == 16 and tile_rows(4096, 8) == 128
