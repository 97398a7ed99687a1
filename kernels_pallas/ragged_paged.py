"""Ragged paged attention for prefill / mixed batches (chunked prefill, prefix-cache hits).

The step's tokens are a flat ragged batch: row r owns tokens ``query_start_loc[r]:
query_start_loc[r + 1]`` at positions ``context_lens[r] + i``; each attends causally to keys
``[0, position]`` of its row, all read in place from the paged cache (the step's own K/V are
written first, so "within the chunk" and "cached context" are one loop over pages).

Work is cut into *tiles*: up to ``block_q`` consecutive tokens of one row times one KV head.
The G query heads of a KV head are folded into the matmul's M dimension (rows = token * Gp +
head), so GQA reads each K/V page once for all its query heads. The tile schedule is a few
small int arrays computed on device in plain JAX (the Triton backend has no scalar prefetch);
its length is a static upper bound, so the program count depends only on the buckets.
Decode tokens may share the call (a tile of one token); for decode-only steps prefer
``paged_decode_attention``, whose split-K keeps the GPU busy at small batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas._common import (
    NEG_INF, dot, is_pow2, load_kv_block, merge_splits, next_pow2, online_softmax_step,
    softcap_scores, split_blocks)


def num_tiles_bound(num_tokens: int, num_rows: int, block_q: int) -> int:
    """Static upper bound on sum_r ceil(q_len_r / block_q): each row adds at most one partial
    tile, and every tile holds at least one token."""
    return max(1, min(num_tokens, num_tokens // block_q + num_rows))


def tile_schedule(query_start_loc: jax.Array, block_q: int, num_tiles: int):
    """(row, first token, token count) of every tile; tiles past the last hold 0 tokens."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    n = (q_lens + block_q - 1) // block_q
    cum = jnp.cumsum(n)
    tid = jnp.arange(num_tiles, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(cum, tid, side="right"), 0, q_lens.shape[0] - 1)
    i = tid - (cum[row] - n[row])
    valid = tid < cum[-1]
    q0 = jnp.where(valid, query_start_loc[row] + i * block_q, 0)
    qlen = jnp.where(valid, jnp.clip(q_lens[row] - i * block_q, 0, block_q), 0)
    return row.astype(jnp.int32), q0.astype(jnp.int32), qlen.astype(jnp.int32)


def _ragged_kernel(q_ref, k_ref, v_ref, bt_ref, ctx_ref, qsl_ref, trow_ref, tq0_ref, tlen_ref,
                   *out_refs, scale: float, window: int | None, cap: float | None,
                   pages_per_block: int, block_q: int, group: int, group_pad: int,
                   num_splits: int):
    t, split = pl.program_id(0), pl.program_id(2)
    num_pages, block_size, head_dim = k_ref.shape
    block_k = pages_per_block * block_size
    M = block_q * group_pad
    row, q0, qlen = trow_ref[t], tq0_ref[t], tlen_ref[t]
    first_pos = ctx_ref[row] + (q0 - qsl_ref[row])

    q = q_ref[pl.ds(q0 * group_pad, M), :]  # [M, D]: token-major, heads folded in
    r = jnp.arange(M)
    tok = r // group_pad
    qpos = first_pos + tok
    row_ok = (tok < qlen) & (r % group_pad < group)
    # Keys [lo, hi) cover every row of the tile; empty tiles visit nothing.
    hi = jnp.where(qlen > 0, first_pos + qlen, 0)
    lo = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)

    def body(i, carry):
        pages = bt_ref[row, pl.ds(i * pages_per_block, pages_per_block)]
        k, v = load_kv_block(k_ref, v_ref, pages, num_pages, head_dim, q.dtype)
        s = softcap_scores(dot(q, k.astype(q.dtype), trans_b=True), scale, cap)
        j = i * block_k + jnp.arange(block_k)
        mask = row_ok[:, None] & (j[None, :] <= qpos[:, None])
        if window is not None:
            mask &= j[None, :] > qpos[:, None] - window
        key_ok = (j < hi) & (j >= lo)
        return online_softmax_step(carry, s, mask, key_ok, v)

    carry = (jnp.zeros((M, head_dim), jnp.float32),
             jnp.full((M,), NEG_INF, jnp.float32), jnp.zeros((M,), jnp.float32))
    b0, b1 = split_blocks(lo // block_k, pl.cdiv(hi, block_k), split, num_splits)
    acc, m, l = jax.lax.fori_loop(b0, b1, body, carry)
    o_ref = out_refs[0]
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    # Masked stores: the rows past qlen belong to the next row's tiles.
    rows = pl.ds(q0 * group_pad, M)
    mine = tok < qlen
    plgpu.store(o_ref.at[rows, :], out, mask=jnp.broadcast_to(mine[:, None], (M, head_dim)))
    if num_splits > 1:  # split-K: the epilogue merges with each split's max / sum
        plgpu.store(out_refs[1].at[rows], m, mask=mine)
        plgpu.store(out_refs[2].at[rows], l, mask=mine)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "pages_per_compute_block", "block_q",
    "num_splits", "num_warps", "num_stages", "interpret"))
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [2, num_blocks, block_size, Hkv, D], this step's K/V already in
    block_tables: jax.Array,  # [R, P] int32
    context_lens: jax.Array,  # [R] int32
    query_start_loc: jax.Array,  # [R + 1] int32 (cu_q_lens)
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    pages_per_compute_block: int = 4,
    block_q: int | None = None,
    num_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """-> [T, Hq, D]; tokens outside every row (padding) get zeros."""
    T, Hq, D = q.shape
    _, num_blocks, bs, Hkv, _ = kv_cache.shape
    R = context_lens.shape[0]
    G = Hq // Hkv
    Gp = next_pow2(G)
    bq = block_q if block_q is not None else default_block_q(G)
    ppb = pages_per_compute_block
    if not (is_pow2(ppb * bs) and is_pow2(D) and is_pow2(bq) and bq * Gp >= 16):
        raise ValueError(f"need power-of-2 pages*block_size ({ppb}*{bs}), head_dim ({D}), "
                         f"block_q ({bq}) and block_q*group >= 16 (tl.dot M)")
    P = block_tables.shape[1]
    if P % ppb:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, -P % ppb)))
    nt = num_tiles_bound(T, R, bq)
    trow, tq0, tlen = tile_schedule(query_start_loc, bq, nt)

    # [Hkv, (T + bq) * Gp, D]: one contiguous row block per tile, never out of bounds.
    Tp = T + bq
    qg = jnp.pad(q.reshape(T, Hkv, G, D), ((0, bq), (0, 0), (0, Gp - G), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(Hkv, Tp * Gp, D)

    kernel = functools.partial(
        _ragged_kernel, scale=scale, window=sliding_window, cap=logits_soft_cap,
        pages_per_block=ppb, block_q=bq, group=G, group_pad=Gp, num_splits=num_splits)
    full = lambda shape: pl.BlockSpec(shape, lambda t, h, s: (0,) * len(shape))  # noqa: E731
    kv_spec = lambda which: pl.BlockSpec(  # noqa: E731
        (None, num_blocks, bs, None, D), lambda t, h, s: (which, 0, 0, h, 0))
    S, TG = num_splits, Tp * Gp
    out_specs = [pl.BlockSpec((None, None, TG, D), lambda t, h, s: (s, h, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((S, Hkv, TG, D), q.dtype if S == 1 else jnp.float32)]
    if S > 1:
        out_specs += [pl.BlockSpec((None, None, TG), lambda t, h, s: (s, h, 0))] * 2
        out_shape += [jax.ShapeDtypeStruct((S, Hkv, TG), jnp.float32)] * 2
    res = pl.pallas_call(
        kernel,
        grid=(nt, Hkv, S),
        in_specs=[
            pl.BlockSpec((None, TG, D), lambda t, h, s: (h, 0, 0)),
            kv_spec(0), kv_spec(1),
            full(block_tables.shape), full((R,)), full((R + 1,)),
            full((nt,)), full((nt,)), full((nt,)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_ppb{ppb}_bq{bq}_s{S}",
    )(qg, kv_cache, kv_cache, block_tables, context_lens, query_start_loc, trow, tq0, tlen)
    out = res[0][0] if S == 1 else merge_splits(*res).astype(q.dtype)
    out = out.reshape(Hkv, Tp, Gp, D)[:, :T, :G].transpose(1, 0, 2, 3).reshape(T, Hq, D)
    # Rows no tile stored (padding tokens) are uninitialised memory on a GPU.
    valid = jnp.arange(T) < query_start_loc[-1]
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))


def default_block_q(group: int, rows: int = 64) -> int:
    """Tokens per tile so that tile rows (tokens * padded group) are ~``rows`` (>= 16)."""
    return max(1, rows // next_pow2(group))
