"""The XLA paged attention equals dense causal attention computed per request, with the decode
rows through the XLA decode loop (``native_decode=False``, the xla backend) and through the C++
kernel (``native_decode=True``, the cpu backend)."""

import numpy as np
import jax.numpy as jnp
import pytest

from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.attention.xla_backend import paged_attention_xla


def _dense(q, k, v, scale, window=None, cap=None):
    """q [L, Hq, D] last rows of a sequence whose full k/v are [S, Hkv, D]."""
    L, Hq, D = q.shape
    S, Hkv, _ = k.shape
    g = Hq // Hkv
    kk = np.repeat(k, g, axis=1)
    vv = np.repeat(v, g, axis=1)
    s = np.einsum("lhd,shd->hls", q, kk) * scale
    if cap:
        s = cap * np.tanh(s / cap)
    qpos = np.arange(S - L, S)[:, None]
    kpos = np.arange(S)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hls,shd->lhd", p, vv)


def _build(rng, reqs, bs, num_blocks, hkv, d, pages_per_req, pad_tokens, pad_rows):
    """reqs: list of (context_len, query_len). Returns cache with contexts written, metadata."""
    cache = rng.standard_normal((2, num_blocks, bs, hkv, d)).astype(np.float32)  # garbage
    free = list(rng.permutation(num_blocks))
    full_k, full_v, tables = [], [], []
    positions, slots, tok_req = [], [], []
    for r, (ctx, ql) in enumerate(reqs):
        total = ctx + ql
        blocks = [free.pop() for _ in range(-(-total // bs))]
        tables.append(blocks + [0] * (pages_per_req - len(blocks)))
        k = rng.standard_normal((total, hkv, d)).astype(np.float32)
        v = rng.standard_normal((total, hkv, d)).astype(np.float32)
        for p in range(ctx):
            cache[0, blocks[p // bs], p % bs] = k[p]
            cache[1, blocks[p // bs], p % bs] = v[p]
        for p in range(ctx, total):
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            tok_req.append(r)
        full_k.append(k)
        full_v.append(v)
    n_rows = len(reqs) + pad_rows
    for _ in range(pad_tokens):
        positions.append(0)
        slots.append(-1)
        tok_req.append(n_rows - 1)
    tables += [[0] * pages_per_req] * pad_rows
    qlens = [ql for _, ql in reqs] + [0] * pad_rows
    md = AttentionMetadata(
        positions=jnp.array(positions, jnp.int32),
        slot_mapping=jnp.array(slots, jnp.int32),
        token_to_req=jnp.array(tok_req, jnp.int32),
        block_tables=jnp.array(tables, jnp.int32),
        seq_lens=jnp.array([c + q for c, q in reqs] + [0] * pad_rows, jnp.int32),
        context_lens=jnp.array([c for c, _ in reqs] + [0] * pad_rows, jnp.int32),
        query_start_loc=jnp.array(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32),
    )
    return cache, md, full_k, full_v


@pytest.fixture(params=[False, True], ids=["xla", "cpu"])
def native(request) -> bool:
    if request.param:
        request.getfixturevalue("cpu_kernels")
    return request.param


@pytest.mark.parametrize("window,cap", [(None, None), (7, None), (None, 5.0)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
def test_mixed_batch_matches_dense(hq, hkv, window, cap, native):
    rng = np.random.default_rng(0)
    bs, d = 4, 16
    # decode with long context, fresh prefill, chunked prefill with context, page boundary
    reqs = [(37, 1), (0, 9), (12, 5), (8, 1), (300, 3)]
    cache, md, full_k, full_v = _build(rng, reqs, bs, 200, hkv, d, 80, pad_tokens=3, pad_rows=2)
    new_k = np.concatenate([k[c:] for k, (c, _) in zip(full_k, reqs)] + [np.full((3, hkv, d), 1e3, np.float32)])
    new_v = np.concatenate([v[c:] for v, (c, _) in zip(full_v, reqs)] + [np.full((3, hkv, d), 1e3, np.float32)])
    T = new_k.shape[0]
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    scale = d ** -0.5
    out, new_cache = paged_attention_xla(
        jnp.array(q), jnp.array(new_k), jnp.array(new_v), jnp.array(cache), md,
        scale=scale, sliding_window=window, logits_soft_cap=cap, native_decode=native)
    out = np.asarray(out)
    start = 0
    for (ctx, ql), k, v in zip(reqs, full_k, full_v):
        ref = _dense(q[start:start + ql], k, v, scale, window, cap)
        np.testing.assert_allclose(out[start:start + ql], ref, atol=2e-5, rtol=1e-5)
        start += ql
    # new K/V landed in their slots; padding tokens wrote nothing
    flat = np.asarray(new_cache).reshape(2, -1, hkv, d)
    slots = np.asarray(md.slot_mapping)
    np.testing.assert_array_equal(flat[0, slots[slots >= 0]], new_k[slots >= 0])
    assert not np.any(flat == 1e3)


@pytest.mark.parametrize("window,cap", [(None, None), (7, 5.0)])
def test_many_decode_rows_match_dense(window, cap, native):
    """A decode-only step wider than one token block of the decode loop (the last block part
    padding), contexts from one key to many chunks: every row still equals dense attention."""
    rng = np.random.default_rng(1)
    bs, d, hq, hkv = 4, 16, 4, 2
    ctxs = list(rng.integers(0, 90, 70))
    ctxs[:4] = [0, 1, 3, 300]  # one key, within a page, across pages, past several chunks
    reqs = [(int(c), 1) for c in ctxs]
    cache, md, full_k, full_v = _build(rng, reqs, bs, 2000, hkv, d, 80, pad_tokens=2, pad_rows=1)
    new_k = np.concatenate([k[c:] for k, (c, _) in zip(full_k, reqs)] + [np.full((2, hkv, d), 1e3, np.float32)])
    new_v = np.concatenate([v[c:] for v, (c, _) in zip(full_v, reqs)] + [np.full((2, hkv, d), 1e3, np.float32)])
    q = rng.standard_normal((new_k.shape[0], hq, d)).astype(np.float32)
    scale = d ** -0.5
    out, _ = paged_attention_xla(jnp.array(q), jnp.array(new_k), jnp.array(new_v), jnp.array(cache), md,
                                 scale=scale, sliding_window=window, logits_soft_cap=cap,
                                 native_decode=native)
    out = np.asarray(out)
    for r, ((ctx, _), k, v) in enumerate(zip(reqs, full_k, full_v)):
        np.testing.assert_allclose(out[r:r + 1], _dense(q[r:r + 1], k, v, scale, window, cap), atol=2e-5, rtol=1e-5)
