"""The pallas backend adapter equals the XLA reference through the AttentionMetadata contract."""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxlm.attention.backends import get_attention_backend
from jaxlm.attention.pallas_backend import PallasBackend, PallasConstraints, make_pallas_backend
from jaxlm.attention.xla_backend import paged_attention_xla
from kp_helpers import assert_close
from tests.helpers.ragged_batch import ragged_step

# The XLA reference multiplies masked V rows by 0, so NaN garbage would reach *its* output;
# against it we use a large finite garbage value (the kernels' own NaN tests are elsewhere).
GARBAGE = 3e3


def _batch(rng, reqs, bs, hkv, d, pages_per_req, pad_tokens, pad_rows, dtype):
    """reqs: (context_len, query_len) per row. Cached context written, new K/V returned."""
    cache, (k, v), md = ragged_step(rng, reqs, bs, hkv, d, garbage=GARBAGE, pages=pages_per_req, spare_blocks=4,
                                    pad_page=0, pad_tokens=pad_tokens, pad_rows=pad_rows)
    return (jnp.asarray(cache, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), md)


def _run_both(reqs, bs, hq, hkv, d, dtype, window, cap, max_query_len=None, seed=0):
    rng = np.random.default_rng(seed)
    cache, k, v, md = _batch(rng, reqs, bs, hkv, d, 16, pad_tokens=3, pad_rows=2, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((k.shape[0], hq, d)), dtype)
    kw = dict(scale=d ** -0.5, sliding_window=window, logits_soft_cap=cap)
    ref, ref_cache = paged_attention_xla(q, k, v, cache, md, **kw)
    backend = PallasBackend(interpret=True)
    # As the runner calls it: inside jit, kv cache donated.
    step = jax.jit(functools.partial(backend, max_query_len=max_query_len, **kw),
                   donate_argnums=(3,))
    out, new_cache = step(q, k, v, cache, md)
    valid = np.asarray(md.slot_mapping) >= 0
    assert_close(np.asarray(out, np.float32)[valid], np.asarray(ref, np.float32)[valid],
                 dtype, "backend vs xla")
    assert not np.any(np.asarray(out, np.float32)[~valid]), "padding tokens must get zeros"
    np.testing.assert_array_equal(np.asarray(new_cache, np.float32),
                                  np.asarray(ref_cache, np.float32))


@pytest.mark.parametrize("bs,hq,hkv,d,dtype,window,cap", [
    (32, 4, 1, 128, jnp.bfloat16, None, None),
    (16, 8, 2, 64, jnp.float32, 7, 5.0),
])
def test_mixed_batch_matches_xla(bs, hq, hkv, d, dtype, window, cap):
    # decode, fresh prefill, chunk after cached pages, page boundary decode, long + chunk
    reqs = [(37, 1), (0, 9), (bs, 5), (2 * bs - 1, 1), (5 * bs + 3, 3)]
    _run_both(reqs, bs, hq, hkv, d, dtype, window, cap)


def test_decode_only_batch_matches_xla():
    reqs = [(0, 1), (15, 1), (16, 1), (150, 1)]
    _run_both(reqs, 16, 8, 2, 64, jnp.float32, 20, None, max_query_len=1, seed=1)


def test_unsupported_shapes_fall_back_to_xla():
    # head_dim 48 / page 12 have no power-of-2 Triton tiles: the backend must still work.
    assert not PallasConstraints.for_cache(16, 48).supported
    assert not PallasConstraints.for_cache(12, 64).supported
    rng = np.random.default_rng(2)
    cache, k, v, md = _batch(rng, [(5, 2), (0, 3)], 12, 1, 48, 4, 1, 1, jnp.float32)
    q = jnp.asarray(rng.standard_normal((k.shape[0], 2, 48)), jnp.float32)
    out, new_cache = PallasBackend(interpret=True)(q, k, v, cache, md, scale=0.1)
    ref, ref_cache = paged_attention_xla(q, k, v, cache, md, scale=0.1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(ref_cache))


def test_registry_and_interpret_choice():
    b = get_attention_backend("pallas")
    assert isinstance(b, PallasBackend) and b.name == "pallas"
    assert make_pallas_backend().interpret == (jax.default_backend() != "gpu")


def test_constraints_round():
    c = PallasConstraints.for_cache(block_size=16, head_dim=128)
    assert c.decode_pages_per_block * 16 == 128 and c.prefill_pages_per_block * 16 == 64
    m = c.page_multiple
    assert c.round_pages(1) == m and c.round_pages(m) == m and c.round_pages(m + 1) == 2 * m
    assert m % c.decode_pages_per_block == 0 and m % c.prefill_pages_per_block == 0
    assert c.round_tokens(37) >= 37
    # splits: many programs for one long request, none for a big batch, never > blocks
    assert c.num_splits(1, 8, 512) == c.max_num_splits
    assert c.num_splits(256, 8, 512) == 1
    assert c.num_splits(1, 1, 8) == 1


@pytest.mark.parametrize("image_run", [False, True])
def test_attn_limits_take_the_xla_path_only_when_a_token_sees_past_itself(image_run):
    """Gemma 3's image tokens (AttentionMetadata.attn_limits): the kernels are causal, so a step
    where some token's limit passes its position runs the XLA path (equal to it, limits
    applied; chosen on the device per step); with limits equal to the positions the result is
    the causal one."""
    import dataclasses

    rng = np.random.default_rng(1)
    cache, k, v, md = _batch(rng, [(0, 12), (16, 7)], 16, 2, 64, 16, pad_tokens=3, pad_rows=2, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((k.shape[0], 4, 64)), jnp.float32)
    limits = np.asarray(md.positions).copy()
    if image_run:
        limits[2:8] = limits[7]  # row 0's tokens 2-7 form an image
    limited = dataclasses.replace(md, attn_limits=jnp.asarray(limits, jnp.int32))
    kw = dict(scale=0.125, sliding_window=None, logits_soft_cap=None)
    ref, _ = paged_attention_xla(q, k, v, cache, limited, **kw)
    causal, _ = paged_attention_xla(q, k, v, cache, md, **kw)
    out, _ = jax.jit(functools.partial(PallasBackend(interpret=True), **kw))(q, k, v, cache, limited)
    valid = np.asarray(md.slot_mapping) >= 0
    assert_close(np.asarray(out)[valid], np.asarray(ref)[valid], jnp.float32, "backend vs xla with limits")
    assert (np.abs(np.asarray(causal) - np.asarray(ref))[valid].max() > 1e-3) == image_run
