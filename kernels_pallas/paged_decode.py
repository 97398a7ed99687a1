"""Paged decode attention (one query token per call row) with a split-K reduction.

Each program handles one (token, KV head, split): the token's G query heads of that KV head
(padded to >= 16 rows so ``tl.dot`` has a legal M) against 1/num_splits of the token's
actual key blocks, reading K/V pages straight out of the cache through the block table (no
gathered copy). Splits write (normalised output, max, sum) and a tiny JAX epilogue merges
them (flash-decoding), so a batch of 1 with a long context still fills the GPU.

Keys of token t are the cache positions ``[0, kv_lens[t])`` of its row (the step's own K/V
must already be written), optionally limited to a sliding window ending at ``kv_lens[t] - 1``.
Because the key range is per token, this kernel is correct for any batch (a prefill token
is just a token whose kv_len is its position + 1); it is *fast* for decode.
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

MIN_DOT_ROWS = 16  # tl.dot needs M >= 16


def _decode_kernel(q_ref, k_ref, v_ref, bt_ref, rows_ref, lens_ref, o_ref, m_ref, l_ref, *,
                   scale: float, window: int | None, cap: float | None,
                   pages_per_block: int, num_splits: int):
    t, s = pl.program_id(0), pl.program_id(2)
    num_pages, block_size, head_dim = k_ref.shape
    block_k = pages_per_block * block_size
    row = rows_ref[t]
    kv_len = lens_ref[t]
    lo = 0 if window is None else jnp.maximum(kv_len - window, 0)
    # Split the token's *actual* key blocks (not the padded table) evenly over the splits,
    # so a short context in a long-max_model_len table still spreads over all of them.
    first_blk = lo // block_k
    end_blk = pl.cdiv(kv_len, block_k)
    b0, b1 = split_blocks(first_blk, end_blk, s, num_splits)

    q = q_ref[...]  # [Gp, D]
    rows = q.shape[0]

    def body(i, carry):
        pages = bt_ref[row, pl.ds(i * pages_per_block, pages_per_block)]
        k, v = load_kv_block(k_ref, v_ref, pages, num_pages, head_dim, q.dtype)
        sc = softcap_scores(dot(q, k.astype(q.dtype), trans_b=True), scale, cap)
        j = i * block_k + jnp.arange(block_k)
        ok = (j < kv_len) & (j >= lo)
        mask = jnp.broadcast_to(ok[None, :], (rows, block_k))
        return online_softmax_step(carry, sc, mask, ok, v)

    carry = (jnp.zeros((rows, head_dim), jnp.float32),
             jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(b0, b1, body, carry)
    # Empty splits / padding tokens (kv_len 0) have l == 0: write zeros, never 0/0.
    o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "pages_per_compute_block", "num_splits",
    "num_warps", "num_stages", "interpret"))
def paged_decode_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: jax.Array,  # [R, P] int32
    token_rows: jax.Array,  # [T] int32: block-table row of each token
    kv_lens: jax.Array,  # [T] int32: keys visible to the token (0 = padding token)
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    pages_per_compute_block: int = 8,
    num_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Attention of each token against its row's first ``kv_lens`` cached keys -> [T, Hq, D]."""
    T, Hq, D = q.shape
    _, num_blocks, bs, Hkv, _ = kv_cache.shape
    G = Hq // Hkv
    ppb = pages_per_compute_block
    if not (is_pow2(ppb * bs) and is_pow2(D)):
        raise ValueError(f"pages_per_compute_block*block_size ({ppb}*{bs}) and head_dim ({D}) "
                         "must be powers of 2 for the Triton lowering")
    # Whole compute blocks are read: pad the table to a multiple of them (a cheap int copy;
    # the runner avoids it by sizing P with PallasConstraints.round_pages).
    P = block_tables.shape[1]
    P_pad = -(-P // ppb) * ppb
    if P_pad != P:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, P_pad - P)))

    Gp = max(MIN_DOT_ROWS, next_pow2(G))
    qg = q.reshape(T, Hkv, G, D)
    if Gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))

    kernel = functools.partial(
        _decode_kernel, scale=scale, window=sliding_window, cap=logits_soft_cap,
        pages_per_block=ppb, num_splits=num_splits)
    R = block_tables.shape[0]
    kv_spec = lambda which: pl.BlockSpec(  # noqa: E731 - K or V of KV head h, whole cache
        (None, num_blocks, bs, None, D), lambda t, h, s: (which, 0, 0, h, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(T, Hkv, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, Gp, D), lambda t, h, s: (t, h, 0, 0)),
            kv_spec(0),
            kv_spec(1),
            pl.BlockSpec((R, P_pad), lambda t, h, s: (0, 0)),
            pl.BlockSpec((T,), lambda t, h, s: (0,)),
            pl.BlockSpec((T,), lambda t, h, s: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, Gp, D), lambda t, h, s: (s, t, h, 0, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda t, h, s: (s, t, h, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda t, h, s: (s, t, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, T, Hkv, Gp, D), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, T, Hkv, Gp), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, T, Hkv, Gp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_decode_ppb{ppb}_s{num_splits}",
    )(qg, kv_cache, kv_cache, block_tables, token_rows, kv_lens)
    out = o[0] if num_splits == 1 else merge_splits(o, m, l)
    return out[:, :, :G].reshape(T, Hq, D).astype(q.dtype)
