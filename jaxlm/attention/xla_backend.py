"""Paged attention in plain jax.numpy: runs on every device, and is the oracle for kernels.

One call writes the step's K/V into their pages, then every query reads its keys, old and new,
from the pages, in two parts that never overlap:

  * decode rows (the leading rows with one query token; the runner puts them first): the
    mat-vec form, each token reading its own row's pages in chunks (``_attend_decode``);
  * every other row (prefill, chunked prefill, the suffix after a prefix-cache hit):
    per-request tiles (``xla_tiles.attend_tiles``), a tile of one row's query tokens against
    one chunk of that row's pages at a time, as a matrix product. A row costs what its own
    query and key counts cost: a fresh prompt beside others never multiplies with their tokens
    (the old in-step part built dense [T, T] scores for the whole step).

Both loops have dynamic trip counts, so their cost follows the step's real rows, not the
padded bucket, and read only valid positions, so garbage in unused pages never leaks in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxlm.attention.kv_quant import read_pages, scatter_kv
from jaxlm.attention.metadata import AttentionMetadata
from kernels_cpu.paged_decode import paged_decode_cpu
from jaxlm.attention.xla_tiles import NEG_INF, attend_tiles, softcap, tile_rows

# Most keys read per decode-loop iteration (rounded to whole pages).
_DECODE_CHUNK_TOKENS = 128
# Most decode tokens per block of the decode loop.
_DECODE_BLOCK = 64
# (token, key) pairs one decode-loop iteration reads, at most: a wide block reads fewer keys
# per token than a lone token does. On XLA:CPU, gathering the pages into the products' layouts
# is most of decode attention's time, its cost per value grows with the size of one gather,
# and a chunk reads up to a chunk past the last key. Tiny Llama, 64 decode rows at context 165:
# body 2.2-2.5 ms with blocks of 16 tokens x 128 keys, 1.8-2.1 with 16 x 32, 1.3-1.4 with
# 64 x 32 (docs/PERF_NOTES.md, session 6). Up to 16 tokens a chunk stays 128 keys.
_DECODE_CHUNK_PAIRS = 2048


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, cache_dtype=None) -> jax.Array:
    """Scatter new K/V ([T, Hkv, D]) into kv_cache [2, num_blocks, block_size, Hkv, D]; an fp8
    cache (``cache_dtype`` for byte storage) gets k / k_scale and v / v_scale, saturated to its
    range (kv_quant.scatter_kv)."""
    _, nb, bs, _, _ = kv_cache.shape
    # Index (block, offset) on the 5-D array: XLA scatters in place into the donated cache
    # (a flattening reshape first made it copy the whole cache every layer).
    block = jnp.where(slot_mapping < 0, nb, slot_mapping // bs)  # out of range -> dropped
    offset = slot_mapping % bs
    kv_cache = scatter_kv(kv_cache, 0, (block, offset), k, k_scale, cache_dtype)
    return scatter_kv(kv_cache, 1, (block, offset), v, v_scale, cache_dtype)


def paged_attention_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    native_decode: bool = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    cache_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """q [T, Hq, D], k/v [T, Hkv, D] (this step's tokens) -> (out [T, Hq, D], new kv_cache).
    ``native_decode``: the decode rows go through the C++ kernel (kernels_cpu, XLA:CPU only;
    load_cpu_kernels() first) instead of the gather-based decode loop. ``k_scale``/``v_scale``:
    an fp8 cache's per-tensor scales (folded into the queries and the output: kv_quant)."""
    T, Hq, D = q.shape
    Hkv = kv_cache.shape[3]
    kv_cache = write_kv(kv_cache, k, v, md.slot_mapping, k_scale, v_scale, cache_dtype)
    # The softmax scale (and an fp8 cache's K scale) goes on the queries once, not on every score.
    qscale = scale if k_scale is None else scale * k_scale
    qf = q.astype(jnp.float32).reshape(T, Hkv, Hq // Hkv, D) * qscale
    rows = tile_rows(md)
    kw = dict(window=sliding_window, cap=logits_soft_cap, cache_dtype=cache_dtype)
    # Decode-only (static): every row is a decode row. Bucket 1 is one too; without the tile
    # loop there, XLA no longer fuses the cache write into hoisted page gathers (which made it
    # copy the whole cache every step: see tests/attention/test_kv_in_place.py).
    if md.max_query_len == 1 or T == 1:
        out = jnp.zeros_like(qf)
    else:
        out = attend_tiles(qf, kv_cache, md, rows, **kw)
    if native_decode:
        out = paged_decode_cpu(qf, kv_cache, md.positions, md.token_to_req, md.block_tables, rows.num_decode,
                               out, **kw)
    else:
        out = _attend_decode(qf, kv_cache, md, rows.num_decode, out, **kw)
    if v_scale is not None:
        out = out * v_scale
    return out.reshape(T, Hq, D).astype(q.dtype), kv_cache


def decode_pages_per_chunk(block: int, page_size: int, max_pages: int) -> int:
    """Pages a decode-loop iteration reads for each of its ``block`` tokens: up to
    _DECODE_CHUNK_TOKENS keys, fewer when the block would pass _DECODE_CHUNK_PAIRS."""
    keys = min(_DECODE_CHUNK_TOKENS, _DECODE_CHUNK_PAIRS // block)
    return max(1, min(max_pages, keys // page_size))


def _attend_decode(qf, kv_cache, md: AttentionMetadata, num_decode, out, *, window, cap, cache_dtype=None):
    """The first ``num_decode`` tokens (one per decode row) attend to keys [0, position] of their
    row, read chunk by chunk through the block table: a mat-vec per token, which is what one
    query token is. Writes their rows of ``out`` [T, Hkv, G, D]."""
    T, Hkv, G, D = qf.shape
    bs = kv_cache.shape[2]
    Bt = min(_DECODE_BLOCK, T)
    pad = (-T) % Bt
    pos, rows = jnp.pad(md.positions, (0, pad)), jnp.pad(md.token_to_req, (0, pad))
    ppc = decode_pages_per_chunk(Bt, bs, md.block_tables.shape[1])
    tables = jnp.pad(md.block_tables, ((0, 0), (0, (-md.block_tables.shape[1]) % ppc)))
    chunk = ppc * bs
    qp = jnp.pad(qf, ((0, pad), (0, 0), (0, 0), (0, 0)))
    outp = jnp.pad(out, ((0, pad), (0, 0), (0, 0), (0, 0)))

    def token_block(b, outp):
        start = b * Bt
        take = lambda x: lax.dynamic_slice_in_dim(x, start, Bt, axis=0)  # noqa: E731
        q_b, pos_b = take(qp), take(pos)
        bt_b = tables[take(rows)]  # [Bt, P]: each token's own row of the block table
        mine = start + jnp.arange(Bt) < num_decode
        hi = jnp.where(mine, pos_b + 1, 0)  # keys [lo, hi) of each token
        lo = jnp.zeros_like(hi) if window is None else jnp.maximum(hi - window, 0)

        def page_chunk(i, carry):
            m, l, acc = carry
            pages = lax.dynamic_slice_in_dim(bt_b, i * ppc, ppc, axis=1)
            kc = read_pages(kv_cache, 0, pages, cache_dtype).reshape(Bt, chunk, Hkv, D)
            vc = read_pages(kv_cache, 1, pages, cache_dtype).reshape(Bt, chunk, Hkv, D)
            j = i * chunk + jnp.arange(chunk)
            mask = (j[None, :] < hi[:, None]) & (j[None, :] >= lo[:, None])  # [Bt, chunk]
            s = softcap(jnp.einsum("thgd,tjhd->thgj", q_b, kc), cap)
            s = jnp.where(mask[:, None, None, :], s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            # Zero V outside the mask: p = 0 times garbage (NaN/inf in an unused page) is NaN.
            vc = jnp.where(mask[:, :, None, None], vc, 0.0)
            acc = alpha[..., None] * acc + jnp.einsum("thgj,tjhd->thgd", p, vc)
            return m_new, alpha * l + p.sum(axis=-1), acc

        init = (jnp.full((Bt, Hkv, G), NEG_INF, jnp.float32), jnp.zeros((Bt, Hkv, G), jnp.float32),
                jnp.zeros((Bt, Hkv, G, D), jnp.float32))
        c0 = jnp.min(jnp.where(mine, lo, jnp.iinfo(jnp.int32).max)) // chunk
        _, l, acc = lax.fori_loop(c0, (jnp.max(hi) + chunk - 1) // chunk, page_chunk, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        o = jnp.where(mine[:, None, None, None], o, take(outp))
        return lax.dynamic_update_slice_in_dim(outp, o, start, axis=0)

    outp = lax.fori_loop(0, (num_decode + Bt - 1) // Bt, token_block, outp)
    return outp[:T]
