"""The math of a mixture-of-experts layer: route, sort by expert, grouped MLP, combine.

Shapes are static: a step of T tokens with top-k routing always has M = T*k (token, expert)
rows, sorted by expert; how many rows each expert gets (the group sizes) is data, so no routing
ever recompiles. Expert compute follows the rows, not ``num_experts``:

- ``grouped_mlp_ragged``: ``jax.lax.ragged_dot`` over the sorted rows (native on GPU and TPU).
- ``grouped_mlp_tiled``: on CPU, where XLA lowers ragged_dot as a dense dot over every expert
  with masks (measured: 8 -> 64 experts at 128 rows, 512x1024 experts, 30 -> 310 ms), a loop
  over tiles of rows padded per expert, each tile one [tile, H] x [H, 2I] and one [tile, I] x
  [I, H] matmul; the loop's trip count (tiles in use) is data too.

``grouped_mlp`` picks one per platform at lowering (``lax.platform_dependent``). Both take the
experts held locally (``expert_start`` + their count): under expert parallelism each device
computes only its experts' rows and leaves the others' rows zero.

Quantized experts pass each product's stored arrays (a tuple, each led by the local-expert dim)
and a ``Dequant``: one expert's arrays -> (float weight [K, N] in the activations' dtype, a
per-column scale [N] for the output or None). The tile loop dequantizes the expert of each tile
inside the step; ragged_dot gets every local expert dequantized (``jax.vmap``), so the stored
bytes stay as they are in memory either way. A format whose two products differ (GGUF: gate/up
and down each of their own block type) passes a Dequant per product (gate/up's, down's).

A format with its own kernel for one expert's product (GGUF's C++ block matmul) passes
``TileProducts`` too: the tile loop then calls them on each tile's rows and expert arrays instead
of dequantizing; ``RaggedProducts`` do the same for ragged_dot (fp8 experts: the fp8 grouped dot
on CUDA).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax

# One product's stored arrays: a float [El, K, ...] weight, or a quantized format's tuple.
ExpertArrays = Union[jax.Array, Sequence[jax.Array]]
# One expert's arrays (expert dim gone), the activations' dtype -> (weight [K, N], scale [N] | None).
Dequant = Callable[[tuple[jax.Array, ...], Any], tuple[jax.Array, "jax.Array | None"]]
# One Dequant for both products, or (gate/up's, down's).
Dequants = Union[Dequant, tuple[Dequant, Dequant]]
# x [R, K] and one expert's arrays (expert dim gone) -> x @ W [R, N] in x's dtype.
TileProduct = Callable[[jax.Array, tuple[jax.Array, ...]], jax.Array]


# x [M, K] sorted by expert, one product's stored arrays (each led by the local-expert dim), the
# local group sizes [El] and each row's local expert [M] -> the grouped product [M, N] in x's dtype.
RaggedProduct = Callable[[jax.Array, tuple[jax.Array, ...], jax.Array, jax.Array], jax.Array]


class TileProducts(NamedTuple):
    """A format's own products of one tile (gate/up: [R, H] -> [R, 2I], gate then up; down:
    [R, I] -> [R, H]), for the tile loop."""

    gate_up: TileProduct
    down: TileProduct


def float_weight(parts: tuple[jax.Array, ...], dtype: Any) -> tuple[jax.Array, None]:
    """The float experts' Dequant: the weight as it is, trailing dims merged ([H, 2, I] -> [H, 2I])."""
    w = parts[0]
    return w.reshape(w.shape[0], -1), None


def _sides(dequant: Dequants) -> tuple[Dequant, Dequant]:
    return dequant if isinstance(dequant, tuple) else (dequant, dequant)


class RaggedProducts(NamedTuple):
    """A format's own grouped products for ``ragged_dot`` (gate/up, down): fp8 experts' fp8 dot on
    CUDA."""

    gate_up: RaggedProduct
    down: RaggedProduct


def dequant_ragged(dequant: Dequant) -> RaggedProduct:
    """The grouped product of formats without their own: every local expert dequantized
    (``jax.vmap``), one ragged_dot, the per-column scale (if any) on the float32 result."""

    def grouped(x, parts, sizes, row_expert):
        w, scale = jax.vmap(lambda *p: dequant(p, x.dtype))(*parts)
        if scale is None:
            return lax.ragged_dot(x, w, sizes)
        y = lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
        return (y * scale.astype(jnp.float32)[row_expert]).astype(x.dtype)

    return grouped


def dequant_products(dequant: Dequants) -> TileProducts:
    """The tile products of formats without a kernel: dequantize the tile's expert, then a dot."""
    gu, down = _sides(dequant)
    return TileProducts(lambda x, p: _product(x, *gu(p, x.dtype)), lambda x, p: _product(x, *down(p, x.dtype)))


def _parts(arrays: ExpertArrays) -> tuple[jax.Array, ...]:
    return tuple(arrays) if isinstance(arrays, (tuple, list)) else (arrays,)


def _product(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    if scale is None:
        return x @ w
    # The per-column scale on the float32 product, as the fp8 Linear applies it (fp8_utils).
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def route(router_logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over the experts (float32), the top-k, renormalised to sum 1 when asked.

    Returns (weights [T, k] float32, expert ids [T, k] int32). Ties go to the lower expert id
    (``lax.top_k``), as a stable sort would.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def sort_by_expert(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(order [M], expert of each sorted row [M]) for ids [T, k]; row j of the sorted batch is
    token ``order[j] // k``."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    return order, flat[order]


def combine(ys: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Sorted expert outputs [M, H] back to tokens: sum_k weight * output, float32 [T, H]."""
    T, k = weights.shape
    unsorted = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
    return jnp.einsum("tkh,tk->th", unsorted.reshape(T, k, -1).astype(jnp.float32), weights)


def _local_group_sizes(es: jax.Array, expert_start: jax.Array, num_local: int) -> tuple[jax.Array, jax.Array]:
    """Rows per local expert [El], and whether each row belongs to one [M]."""
    local = es - expert_start
    mine = (local >= 0) & (local < num_local)
    sizes = jnp.zeros(num_local, jnp.int32).at[jnp.clip(local, 0, num_local - 1)].add(mine.astype(jnp.int32))
    return sizes, mine


def _gated(act: Callable[[jax.Array], jax.Array], gate_up: jax.Array) -> jax.Array:
    """[..., 2, I] gate and up projections -> act(gate) * up."""
    return act(gate_up[..., 0, :]) * gate_up[..., 1, :]


def grouped_mlp_ragged(xs: jax.Array, es: jax.Array, w_gate_up: ExpertArrays, w_down: ExpertArrays,
                       expert_start: jax.Array, act: Callable[[jax.Array], jax.Array],
                       dequant: Dequants = float_weight, ragged: RaggedProducts | None = None) -> jax.Array:
    """Each sorted row through its expert's gated MLP with ``ragged_dot`` (or ``ragged``'s
    products, which replace ``dequant`` here); rows of experts not held here ([expert_start,
    expert_start + El) are) give zeros.

    xs [M, H] sorted by expert, es [M] their (global) expert ids, w_gate_up [El, H, 2, I],
    w_down [El, I, H] (or each a tuple of stored arrays that ``dequant`` turns into them)."""
    M = xs.shape[0]
    gate_up, down = _parts(w_gate_up), _parts(w_down)
    El = gate_up[0].shape[0]
    sizes, mine = _local_group_sizes(es, expert_start, El)
    # The local rows are contiguous in the sorted batch: rotate them to the front.
    first = jnp.sum(es < expert_start).astype(jnp.int32)
    idx = (jnp.arange(M, dtype=jnp.int32) + first) % M
    x = xs[idx]
    row_expert = jnp.clip(es[idx] - expert_start, 0, El - 1)

    prod = ragged or RaggedProducts(*map(dequant_ragged, _sides(dequant)))
    h = prod.gate_up(x, gate_up, sizes, row_expert)
    y = prod.down(_gated(act, h.reshape(M, 2, -1)), down, sizes, row_expert)
    y = jnp.where((jnp.arange(M) < jnp.sum(sizes))[:, None], y, 0)
    return jnp.zeros_like(y).at[idx].set(y, unique_indices=True)


def tile_rows(num_rows: int, num_local: int) -> int:
    """Rows per tile: about the mean group size (a power of 2 in [4, 128]), so a decode step over
    many experts pads little and a long prefill runs large matmuls."""
    mean = max(1, -(-num_rows // max(1, num_local)))
    return int(min(128, max(4, 1 << (mean - 1).bit_length())))


def grouped_mlp_tiled(xs: jax.Array, es: jax.Array, w_gate_up: ExpertArrays, w_down: ExpertArrays,
                      expert_start: jax.Array, act: Callable[[jax.Array], jax.Array],
                      tile: int | None = None, dequant: Dequants = float_weight,
                      products: TileProducts | None = None) -> jax.Array:
    """Same contract as ``grouped_mlp_ragged``, as a loop over tiles that each hold one expert's
    rows (each group padded up to whole tiles); only the tiles in use run, and each dequantizes
    only its own expert (or multiplies it by ``products``, which replace ``dequant`` here)."""
    M, H = xs.shape
    gate_up, down = _parts(w_gate_up), _parts(w_down)
    El = gate_up[0].shape[0]
    tm = tile or tile_rows(M, El)
    sizes, mine = _local_group_sizes(es, expert_start, El)
    padded = (sizes + tm - 1) // tm * tm
    pad_end = jnp.cumsum(padded)
    local = jnp.clip(es - expert_start, 0, El - 1)
    first = jnp.sum(es < expert_start)
    rank = jnp.arange(M, dtype=jnp.int32) - first - (jnp.cumsum(sizes) - sizes)[local]
    # Static bound on the padded rows: every group in use wastes at most tm - 1 rows.
    cap = -(-(M + min(El, M) * (tm - 1)) // tm) * tm
    dest = jnp.where(mine, pad_end[local] - padded[local] + rank, cap)  # cap: dropped
    xp = jnp.zeros((cap, H), xs.dtype).at[dest].set(xs, mode="drop")
    tile_expert = jnp.searchsorted(pad_end, jnp.arange(cap // tm) * tm, side="right")
    prod = products or dequant_products(dequant)

    def body(t, yp):
        x = lax.dynamic_slice_in_dim(xp, t * tm, tm)
        e = tile_expert[t]
        h = _gated(act, prod.gate_up(x, tuple(p[e] for p in gate_up)).reshape(tm, 2, -1))
        return lax.dynamic_update_slice_in_dim(yp, prod.down(h, tuple(p[e] for p in down)), t * tm, 0)

    yp = lax.fori_loop(0, pad_end[-1] // tm, body, jnp.zeros((cap, H), xs.dtype))
    return yp.at[dest].get(mode="fill", fill_value=0)


def grouped_mlp(xs: jax.Array, es: jax.Array, w_gate_up: ExpertArrays, w_down: ExpertArrays,
                expert_start: jax.Array, act: Callable[[jax.Array], jax.Array],
                dequant: Dequants = float_weight, products: TileProducts | None = None,
                ragged: RaggedProducts | None = None) -> jax.Array:
    """The grouped expert MLP, lowered per platform: tiles on CPU (through ``products`` when
    given), ``ragged_dot`` elsewhere (through ``ragged`` when given)."""
    return lax.platform_dependent(
        xs, es, _parts(w_gate_up), _parts(w_down), expert_start,
        cpu=lambda *a: grouped_mlp_tiled(*a, act, dequant=dequant, products=products),
        default=lambda *a: grouped_mlp_ragged(*a, act, dequant=dequant, ragged=ragged))
