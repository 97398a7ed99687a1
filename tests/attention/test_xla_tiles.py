"""The per-request tiled XLA attention equals a dense reference on ragged batches: several rows in
one step, each with its own cached context and query length, decode rows first or not, tiles
and key chunks cut at awkward places, sliding windows and soft-capping, NaN in unused pages."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm.attention.xla_tiles as xla_tiles
from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.attention.xla_backend import paged_attention_xla
from kernels_pallas.reference import ragged_paged_reference, write_kv_reference
from tests.helpers.ragged_batch import ragged_step


def _step(rng, rows, bs, hq, hkv, d, pad_tokens=3, pad_rows=2):
    """rows: (context_len, query_len) each. Cache of NaN with each row's context written;
    returns (q, k, v, cache, md) with the step's new K/V apart, as a model hands them over."""
    cache, (k, v), md = ragged_step(rng, rows, bs, hkv, d, garbage=np.nan, pad_tokens=pad_tokens, pad_rows=pad_rows)
    q = rng.standard_normal((k.shape[0], hq, d)).astype(np.float32)
    q[k.shape[0] - pad_tokens:] = np.nan  # padding query slots hold garbage too
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cache), md


def _check(rows, bs, hq, hkv, d, window=None, cap=None, max_query_len=None, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, cache, md = _step(rng, rows, bs, hq, hkv, d)
    if max_query_len is not None:
        md = AttentionMetadata(**{f: getattr(md, f) for f in (
            "positions", "slot_mapping", "token_to_req", "block_tables", "seq_lens",
            "context_lens", "query_start_loc")}, max_query_len=max_query_len)
    kw = dict(scale=d ** -0.5, sliding_window=window, logits_soft_cap=cap)
    # As the runner calls it: inside jit, the cache donated.
    step = jax.jit(functools.partial(paged_attention_xla, **kw), donate_argnums=(3,))
    full = write_kv_reference(cache, k, v, md.slot_mapping)
    ref = ragged_paged_reference(q, full, md.block_tables, md.context_lens, md.query_start_loc, **kw)
    out, new_cache = step(q, k, v, cache, md)
    out, ref = np.asarray(out), np.asarray(ref)
    n = int(md.query_start_loc[-1])
    assert np.isfinite(out).all(), "garbage leaked into the output"
    np.testing.assert_allclose(out[:n], ref[:n], atol=2e-5, rtol=2e-5)
    assert not out[n:].any(), "padding tokens get zeros"
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(full))


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 tokens, chunks of 16 keys and long steps of 32, so short rows cross many
    tile / chunk / long-step edges."""
    monkeypatch.setattr(xla_tiles, "BLOCK_Q", 8)
    monkeypatch.setattr(xla_tiles, "CHUNK_TOKENS", 16)
    monkeypatch.setattr(xla_tiles, "LONG_CHUNK_TOKENS", 32)


# Decode rows first (as the runner orders them), then: fresh prefill of 1 tile + 1 token, a
# chunk after a page-aligned prefix hit, a 1-token chunk after context (a decode-like row
# out of the leading run), a chunk crossing page and tile edges, a long context + short
# suffix, an exact tile.
ROWS = [(37, 1), (5, 1), (0, 1), (0, 9), (16, 5), (11, 1), (13, 23), (150, 3), (0, 8)]


@pytest.mark.parametrize("hq,hkv,window,cap", [
    (4, 2, None, None),
    (6, 2, 7, None),  # group 3, window shorter than a tile
    (4, 1, 20, 5.0),  # MQA, window across chunks, soft cap
    (2, 2, None, 30.0),
])
def test_ragged_batch_matches_dense(small_tiles, hq, hkv, window, cap):
    _check(ROWS, 4, hq, hkv, 16, window, cap)


@pytest.mark.parametrize("long_tokens,window", [(48, None), (64, 37)])
def test_tail_pieces(small_tiles, monkeypatch, long_tokens, window):
    # Long steps of 3 and 4 chunks: what they leave of a row's keys goes with the diagonal
    # through the masked steps of 2 chunks then 1; tails of every length, several long steps.
    monkeypatch.setattr(xla_tiles, "LONG_CHUNK_TOKENS", long_tokens)
    _check(ROWS + [(100, 20), (61, 40), (190, 9)], 4, 6, 2, 16, window)


def test_default_tiles_long_rows():
    # Default-size tiles, chunks and long steps: a fresh 300-token prompt, a 130-token chunk
    # after 700 cached tokens, a 40-token suffix after 1,100 (a long step, then the tail with
    # the diagonal, masked), decodes deep into their contexts.
    rows = [(900, 1), (257, 1), (0, 300), (700, 130), (64, 129), (1100, 40)]
    _check(rows, 16, 9, 3, 16)
    _check(rows, 16, 4, 2, 16, window=200, seed=1)


def test_decode_only_static(small_tiles):
    # max_query_len == 1: the tile loop is not even traced; every row runs as a mat-vec.
    _check([(37, 1), (0, 1), (5, 1), (64, 1)], 4, 4, 2, 16, window=9, max_query_len=1)


def _limited_reference(q, cache, md, limits, window, scale):
    """Dense NumPy: token t of row r sees the row's keys j with lo <= j <= limits[t] (lo: the
    window counted back from t's own position), read through the block table."""
    q, cache = np.asarray(q, np.float64), np.asarray(cache, np.float64)
    pos, req, tables = np.asarray(md.positions), np.asarray(md.token_to_req), np.asarray(md.block_tables)
    bs, hq, hkv = cache.shape[2], q.shape[1], cache.shape[3]
    out = np.zeros_like(q)
    for t in range(int(md.query_start_loc[-1])):
        keys = np.arange(int(limits[t]) + 1)
        keys = keys[keys > pos[t] - window] if window else keys
        page = tables[req[t]][keys // bs]
        k, v = cache[0, page, keys % bs], cache[1, page, keys % bs]  # [n, hkv, d]
        for h in range(hq):
            s = k[:, h // (hq // hkv)] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ v[:, h // (hq // hkv)] / p.sum()
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_attn_limits_let_image_runs_see_their_later_tokens(small_tiles, window):
    """AttentionMetadata.attn_limits (Gemma 3's image tokens): a run of tokens sees up to its
    last position, across tile (8) and chunk (16) edges and past a window shorter than the run;
    a run that starts at the row's first query token (a prefix hit inside an image); decode rows
    and text tokens stay causal."""
    rows = [(9, 1), (0, 1), (0, 30), (20, 12)]
    rng = np.random.default_rng(3)
    q, k, v, cache, md = _step(rng, rows, 4, 4, 2, 16)
    pos = np.asarray(md.positions)
    limits = pos.copy()
    starts = np.asarray(md.query_start_loc)
    for row, (a, b) in ((2, (3, 17)), (2, (20, 24)), (3, (0, 5))):  # runs [a, b) of a row's query tokens
        lo = starts[row]
        limits[lo + a:lo + b] = pos[lo + b - 1]
    md = dataclasses.replace(md, attn_limits=jnp.asarray(limits, jnp.int32))
    kw = dict(scale=16 ** -0.5, sliding_window=window)
    full = write_kv_reference(cache, k, v, md.slot_mapping)
    out, _ = jax.jit(functools.partial(paged_attention_xla, **kw))(q, k, v, cache, md)
    n = int(starts[-1])
    ref = _limited_reference(q, full, md, limits, window, kw["scale"])
    np.testing.assert_allclose(np.asarray(out)[:n], ref[:n], atol=2e-5, rtol=2e-5)
    causal = _limited_reference(q, full, md, pos, window, kw["scale"])
    assert np.abs(causal[:n] - ref[:n]).max() > 0.05  # the limits do change what the runs see
