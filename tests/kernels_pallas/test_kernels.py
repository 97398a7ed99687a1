"""Each kernel, in interpret mode, equals its pure-JAX reference (CPU)."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from kernels_pallas.paged_decode import paged_decode_attention
from kernels_pallas.ragged_paged import ragged_paged_attention, tile_schedule
from kernels_pallas.reference import (
    paged_decode_reference, ragged_paged_reference, ragged_token_layout)
from kp_helpers import assert_close, paged_cache

f32, bf16 = jnp.float32, jnp.bfloat16
# What unused cache slots hold: NaN, or inf (0 * inf is NaN too), must never reach outputs.
GARBAGE = {f32: np.nan, bf16: np.inf}

# (block_size, head_dim, Hq, Hkv, dtype, num_splits, window, softcap): a covering set of the
# grid (page 16/32 x head_dim 64/128 x GQA 1/4/8 x f32/bf16), not the full product, since
# each interpret-mode call costs seconds.
DECODE_CASES = [
    (16, 64, 2, 2, f32, 1, None, None),  # MHA
    (32, 128, 4, 1, bf16, 2, None, 5.0),  # MQA, group 4
    (16, 128, 8, 1, f32, 4, 40, None),  # group 8, window crossing splits
    (32, 64, 6, 2, bf16, 2, 40, 30.0),  # group 3 (padded to 4)
]


@pytest.mark.parametrize("bs,d,hq,hkv,dtype,splits,window,cap", DECODE_CASES)
def test_decode_matches_reference(bs, d, hq, hkv, dtype, splits, window, cap):
    rng = np.random.default_rng(bs + d + hq)
    # context 1, exactly one / two pages, a page + 1, long (many blocks, crosses splits)
    lens = [1, bs, 2 * bs, bs + 1, 9 * bs + 3]
    pages = 12
    cache, tables = paged_cache(rng, lens, bs, hkv, d, dtype, pages, garbage=GARBAGE[dtype])
    T = len(lens) + 1  # + one padding token (kv_len 0) with huge q
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    q[-1] = 1e4
    q = jnp.asarray(q, dtype)
    rows = jnp.asarray(list(range(len(lens))) + [0], jnp.int32)
    kv_lens = jnp.asarray(lens + [0], jnp.int32)
    kw = dict(scale=d ** -0.5, sliding_window=window, logits_soft_cap=cap)
    out = paged_decode_attention(q, cache, tables, rows, kv_lens, pages_per_compute_block=2,
                                 num_splits=splits, interpret=True, **kw)
    ref = paged_decode_reference(q, cache, tables, rows, kv_lens, **kw)
    assert_close(out, ref, dtype, "decode")
    assert not np.any(np.asarray(out[-1], np.float32)), "padding token must get zeros"


# rows (context_len, query_len): decode, fresh prefill, chunk after a full page (prefix hit),
# chunk crossing a page boundary, long context + short chunk, then padding rows/tokens.
def _rows(bs):
    return [(37, 1), (0, 9), (bs, 5), (2 * bs - 3, 7), (6 * bs + 1, 3), (0, 1)]


# + (block_q, num_splits)
RAGGED_CASES = [
    (16, 64, 2, 2, f32, None, None, 16, 1),
    (32, 128, 4, 1, bf16, None, 5.0, 8, 2),
    (16, 128, 8, 1, bf16, 20, None, 2, 1),
    (32, 64, 6, 2, f32, 7, 30.0, 4, 4),  # group 3 (padded to 4), tiny window
]


@pytest.mark.parametrize("bs,d,hq,hkv,dtype,window,cap,block_q,splits", RAGGED_CASES)
def test_ragged_matches_reference(bs, d, hq, hkv, dtype, window, cap, block_q, splits):
    rng = np.random.default_rng(bs * d + hq)
    rows = _rows(bs)
    pad_rows, pad_tokens = 2, 3
    seq = [c + n for c, n in rows] + [0] * pad_rows
    cache, tables = paged_cache(rng, seq, bs, hkv, d, dtype, 8, garbage=GARBAGE[dtype])
    qlens = [n for _, n in rows] + [0] * pad_rows
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    ctx = jnp.asarray([c for c, _ in rows] + [0] * pad_rows, jnp.int32)
    T = sum(qlens) + pad_tokens
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    q[-pad_tokens:] = np.nan  # padding query slots hold garbage too
    q = jnp.asarray(q, dtype)
    kw = dict(scale=d ** -0.5, sliding_window=window, logits_soft_cap=cap)
    out = ragged_paged_attention(q, cache, tables, ctx, qsl, pages_per_compute_block=2,
                                 block_q=block_q, num_splits=splits, interpret=True, **kw)
    ref = ragged_paged_reference(q, cache, tables, ctx, qsl, **kw)
    assert_close(out, ref, dtype, "ragged")


def test_tile_schedule_covers_every_token_once():
    qsl = jnp.asarray([0, 1, 10, 10, 15, 15], jnp.int32)
    rows, q0, qlen = (np.asarray(a) for a in tile_schedule(qsl, 4, 12))
    seen = np.zeros(15, int)
    for r, s, n in zip(rows, q0, qlen):
        assert n == 0 or (qsl[r] <= s and s + n <= qsl[r + 1])
        seen[s:s + n] += 1
    assert (seen == 1).all()


def test_ragged_layout_positions():
    rows, kv_lens = ragged_token_layout(jnp.asarray([3, 0]), jnp.asarray([0, 2, 3]), 5)
    assert rows.tolist()[:3] == [0, 0, 1]
    assert kv_lens.tolist() == [4, 5, 1, 0, 0]


def test_ragged_long_context_in_chunks_and_prefix_hit_suffix():
    """A 2,000-token prompt computed in four uneven chunks (each chunk a row whose context is
    every earlier chunk, read back from the pages), a short suffix after a 1,408-token prefix
    hit, and a decode row, in one call: the same per-request tiles over long cached contexts,
    tiles and key blocks crossing chunk and page edges. Split-K on, as a small bucket has it."""
    bs, d, hq, hkv = 32, 16, 4, 1
    rng = np.random.default_rng(29)
    seqs = [2000, 1408 + 100, 731]
    pages = -(-max(seqs) // bs) + 1
    cache, tables = paged_cache(rng, seqs, bs, hkv, d, f32, pages)
    chunks = [(0, 700), (700, 300), (1000, 513), (1513, 487)]
    rows = [(0, c, n) for c, n in chunks] + [(1, 1408, 100), (2, 730, 1)]
    tables = tables[jnp.asarray([s for s, _, _ in rows])]
    ctx = jnp.asarray([c for _, c, _ in rows], jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum([n for _, _, n in rows])]), jnp.int32)
    T = int(qsl[-1])
    q = jnp.asarray(rng.standard_normal((T, hq, d)), f32)
    kw = dict(scale=d ** -0.5, sliding_window=None, logits_soft_cap=None)
    out = ragged_paged_attention(q, cache, tables, ctx, qsl, pages_per_compute_block=2,
                                 block_q=32, num_splits=2, interpret=True, **kw)
    # The reference gathers every key of every token: run it on pieces of <= 256 tokens of one
    # row, all of one shape (the piece's tail past its row is padding and comes back zero).
    qp = jnp.pad(q, ((0, 256), (0, 0), (0, 0)))
    for r, (_, c, n) in enumerate(rows):
        for s in range(0, n, 256):
            m, t0 = min(256, n - s), int(qsl[r]) + s
            ref = ragged_paged_reference(qp[t0:t0 + 256], cache, tables[r:r + 1],
                                         jnp.asarray([c + s], jnp.int32),
                                         jnp.asarray([0, m], jnp.int32), **kw)
            assert_close(out[t0:t0 + m], ref[:m], f32, f"row {r} tokens {s}:{s + m}")
