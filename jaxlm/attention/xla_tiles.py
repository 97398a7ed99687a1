"""Per-request tiled attention over the paged cache, in plain XLA (prefill and mixed steps).

What ragged paged attention kernels do, as two nested loops with dynamic trip counts: the
outer one over *tiles* (up to ``block_q`` consecutive query tokens of one row), the inner one
over *chunks* of that row's keys (``chunk`` tokens, whole pages gathered through the block
table). A tile times a chunk is a matrix product, [Hkv, block_q * G, D] x [Hkv, D, chunk]
(the G query heads of a KV head folded into the rows, so each page is read once per tile for
all of them), merged with an online softmax. A tile visits only the chunks that hold its
keys: from its sliding window's start (or 0) to its last token's position. So a row costs its
own query length x its own key count, whatever else is in the step, and the step's new K/V
(already written to the cache) and its cached context are one loop. The key loop goes in as
few steps as it can: ``LONG_CHUNK_TOKENS`` keys at a time, then the rest with the diagonal,
masked, two chunks at a time (XLA:CPU pays a fixed cost per step, and every loop is code in
every layer: PERF_NOTES "session 6" and "session 7").

The leading decode rows (one query token each) are not tiled; ``xla_backend`` runs them in
the mat-vec form. The queries are laid out head-major once per call ([Hkv, tokens x G, D]),
so a tile is one contiguous slice and no transpose runs inside the loops.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlm.attention.kv_quant import read_pages
from jaxlm.attention.metadata import AttentionMetadata

# Finite "minus infinity": exp(NEG_INF - m) underflows to 0 and NEG_INF - NEG_INF stays 0.
NEG_INF = -1e30
# Query tokens per tile (smaller buckets use their own size; 256 took fewer steps but computed
# more of each diagonal: 1.22x slower on a fresh 256-token prompt under load) and keys per
# chunk (the smallest key step).
BLOCK_Q = 128
CHUNK_TOKENS = 128
# Keys per step over the chunks a tile sees whole (long cached contexts).
LONG_CHUNK_TOKENS = 1024


class TileRows(NamedTuple):
    """The step's rows as the two loops see them (device arrays)."""

    q_lens: jax.Array  # [R] query tokens of each row
    num_decode: jax.Array  # () leading rows with exactly one query token: tokens [0, num_decode)


def tile_rows(md: AttentionMetadata) -> TileRows:
    qsl = md.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]
    num_decode = jnp.sum(jnp.cumprod((q_lens == 1).astype(jnp.int32)))
    return TileRows(q_lens, num_decode)


def softcap(s: jax.Array, cap: float | None) -> jax.Array:
    """Scores of queries already multiplied by the softmax scale, soft-capped when asked."""
    return s if cap is None else cap * jnp.tanh(s / cap)


def block_q_for(num_tokens: int) -> int:
    """Tile height for a bucket of ``num_tokens``: BLOCK_Q, or the bucket's size when smaller."""
    return max(1, min(BLOCK_Q, num_tokens))


def _pieces(span: int) -> list[int]:
    """Step sizes (chunks) for a tail of any length: ``span``, then the powers of two below it."""
    return [span] + [1 << k for k in range((span - 1).bit_length() - 1, -1, -1)]


def attend_tiles(qf: jax.Array, kv_cache: jax.Array, md: AttentionMetadata, rows: TileRows, *,
                 window: int | None, cap: float | None, cache_dtype=None) -> jax.Array:
    """qf [T, Hkv, G, D] (f32, times the softmax scale) -> out [T, Hkv, G, D]: every token of a
    non-decode row attends to keys [lo, position] of its row (lo: its sliding window's first
    key, else 0; ``md.attn_limits``: keys up to the token's limit instead of its position, the
    window still counted back from its position, as transformers' Gemma 3 image mask), read
    from the cache; other tokens (decode rows, padding) get zeros."""
    T, Hkv, G, D = qf.shape
    bs = kv_cache.shape[2]
    Bq = block_q_for(T)
    M = Bq * G
    ppc = max(1, min(md.block_tables.shape[1], CHUNK_TOKENS // bs))
    chunk = ppc * bs
    bt = jnp.pad(md.block_tables, ((0, 0), (0, (-md.block_tables.shape[1]) % ppc)))
    span = max(1, min(LONG_CHUNK_TOKENS // chunk, bt.shape[1] // ppc))  # chunks per long step
    qsl, ctx = md.query_start_loc, md.context_lens
    R = rows.q_lens.shape[0]
    tiles = jnp.where(jnp.arange(R) >= rows.num_decode, (rows.q_lens + Bq - 1) // Bq, 0)
    cum = jnp.cumsum(tiles)
    # Head-major, one padding tile at the end: a tile is the slice [q0 * G, q0 * G + M).
    qh = jnp.pad(qf, ((0, Bq), (0, 0), (0, 0), (0, 0))).transpose(1, 0, 2, 3).reshape(Hkv, -1, D)
    tok = jnp.arange(M) // G  # tile row -> token within the tile
    limits = None if md.attn_limits is None else jnp.pad(md.attn_limits, (0, Bq))

    def tile(t, out):
        row = jnp.minimum(jnp.searchsorted(cum, t, side="right"), R - 1)
        i = t - (cum[row] - tiles[row])
        q0 = qsl[row] + i * Bq
        qlen = jnp.minimum(rows.q_lens[row] - i * Bq, Bq)
        first = ctx[row] + i * Bq  # position of the tile's first token
        qpos = first + tok
        mine = tok < qlen
        hi = first + qlen  # keys [lo, hi) cover every token of the tile
        if limits is None:
            qlim = qpos
        else:  # a token may see keys past its position (in this step: written above)
            qlim = jnp.where(mine, lax.dynamic_slice_in_dim(limits, q0, Bq)[tok], qpos)
            hi = jnp.maximum(hi, jnp.max(jnp.where(mine, qlim + 1, 0)))
        lo = 0 if window is None else jnp.maximum(first - window + 1, 0)
        # The tile's own tokens still hold their queries: the loop's buffer starts as qh, and
        # a tile writes only its own tokens.
        q_t = lax.dynamic_slice_in_dim(out, q0 * G, M, axis=1)  # [Hkv, M, D]

        def key_chunk(c, carry, masked: bool, span: int = 1):
            """Keys of chunks [c, c + span) into the online softmax (m, l, acc)."""
            m, l, acc = carry
            pages = lax.dynamic_slice_in_dim(bt[row], c * ppc, span * ppc)
            n = span * chunk
            kc = read_pages(kv_cache, 0, pages, cache_dtype).reshape(n, Hkv, D)
            vc = read_pages(kv_cache, 1, pages, cache_dtype).reshape(n, Hkv, D)
            s = softcap(jnp.einsum("hmd,jhd->hmj", q_t, kc), cap)
            if masked:
                j = c * chunk + jnp.arange(n)
                mask = mine[:, None] & (j[None, :] <= qlim[:, None])  # [M, n]
                if window is not None:
                    mask &= j[None, :] > qpos[:, None] - window
                s = jnp.where(mask[None], s, NEG_INF)
                # Zero V outside the row's keys: p = 0 times garbage (NaN in an unused page) is NaN.
                vc = jnp.where(((j < hi) & (j >= lo))[:, None, None], vc, 0.0)
            m_new = jnp.maximum(m, s.max(axis=-1))
            # Masked scores need no second select: exp(NEG_INF - m) is 0 once the row has seen a
            # key, and a row with none yet (m = NEG_INF) gets p = 1 here, wiped later by
            # alpha = exp(NEG_INF - m_real) = 0 (every row of the tile sees its own position).
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            acc = alpha[..., None] * acc + jnp.einsum("hmj,jhd->hmd", p, vc)
            return m_new, alpha * l + p.sum(axis=-1), acc

        # Chunks every token of the tile sees whole (before its first token, inside the window
        # of its last) need no mask: on a long context that is all but one or two of them, and
        # they go LONG_CHUNK keys at a time (ops big enough for XLA:CPU to split over threads).
        # (Rows past qlen may then hold garbage; they are dropped below.)
        c_lo, c_hi = lo // chunk, (hi + chunk - 1) // chunk
        c_in0 = c_lo if window is None else jnp.clip((hi - 1 - window) // chunk + 1, c_lo, c_hi)
        c_in1 = jnp.clip((first + 1) // chunk, c_in0, c_hi)
        carry = (jnp.full((Hkv, M), NEG_INF, jnp.float32), jnp.zeros((Hkv, M), jnp.float32),
                 jnp.zeros((Hkv, M, D), jnp.float32))
        if window is not None:  # chunks at the window's start, masked
            carry = lax.fori_loop(c_lo, c_in0, functools.partial(key_chunk, masked=True), carry)
        # The unmasked chunks in long steps; what they leave and the tile's diagonal (at most
        # ceil(Bq / chunk) + 1 chunks) masked, two chunks a step then one. Every loop step costs
        # XLA:CPU ~0.1-0.2 ms of fixed overhead (a dozen thunks, each split over the threads), so
        # a few big steps beat many 128-key ones; and every loop is code in every layer of the
        # program (more piece sizes grew the body programs by half), so three loops in all.
        n = (c_in1 - c_in0) // span
        carry = lax.fori_loop(0, n, lambda i, cr: key_chunk(c_in0 + i * span, cr, False, span), carry)
        c = c_in0 + n * span
        for p in _pieces(min(span, 2)):
            n = (c_hi - c) // p
            carry = lax.fori_loop(0, n, lambda i, cr, c=c, p=p: key_chunk(c + i * p, cr, True, p), carry)
            c = c + n * p
        _, l, acc = carry
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        # Rows past qlen belong to the next row's tiles (or padding): keep what is there (q).
        o = jnp.where(mine[None, :, None], o, q_t)
        return lax.dynamic_update_slice_in_dim(out, o, q0 * G, axis=1)

    # The loop works in qh's buffer (a zeroed one cost a copy per layer); tokens no tile wrote
    # (decode rows, padding) still hold queries, zeroed on the way out.
    out = lax.fori_loop(0, cum[-1], tile, qh)
    out = out.reshape(Hkv, T + Bq, G, D)[:, :T].transpose(1, 0, 2, 3)
    t = jnp.arange(T)
    return jnp.where(((t >= rows.num_decode) & (t < qsl[-1]))[:, None, None, None], out, 0.0)
