"""Pieces shared by the paged attention kernels (Pallas GPU / Triton lowering)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

# Finite "minus infinity": exp(NEG_INF - m) underflows to 0 and NEG_INF - NEG_INF stays 0
# (a true -inf would give NaN in the online-softmax correction of fully masked rows).
NEG_INF = -1e30


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """2-D matmul with f32 accumulation; f32 inputs use IEEE precision (no silent TF32)."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_b=trans_b, precision=prec).astype(jnp.float32)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def load_kv_block(k_ref, v_ref, pages: jax.Array, num_pages: int, head_dim: int, compute_dtype=None):
    """Gather ``len(pages)`` pages of K and V ([num_blocks, block_size, D] refs) in place.

    Page ids are clamped to the cache so a garbage entry in a padded block table can never
    become an out-of-bounds read; whatever such a page holds is masked by the caller. An fp8
    cache is converted to ``compute_dtype`` (the queries') here, in registers: the caller folds
    the K/V scales into the queries and the output, so the raw values are all a kernel needs.
    """
    pages = jnp.clip(pages, 0, num_pages - 1)
    n = pages.shape[0] * k_ref.shape[1]
    k = k_ref[pages].reshape(n, head_dim)
    v = v_ref[pages].reshape(n, head_dim)
    if compute_dtype is not None and is_fp8(k.dtype):
        k, v = k.astype(compute_dtype), v.astype(compute_dtype)
    return k, v


def softcap_scores(s: jax.Array, scale: float, cap: float | None) -> jax.Array:
    s = s * scale
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    return s


def online_softmax_step(carry, s: jax.Array, mask: jax.Array, key_ok: jax.Array, v: jax.Array):
    """One flash-attention update. s/mask [M, K] f32/bool, key_ok [K] (a superset of the keys
    any row may see), v [K, D]; carry (acc [M, D], m, l [M]).

    Masked probabilities are forced to 0 and masked V rows to 0, so NaN/inf garbage in unused
    cache slots cannot reach the result (0 * NaN would otherwise be NaN).
    """
    acc, m_prev, l_prev = carry
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m_prev, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + p.sum(axis=-1)
    v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))
    acc = alpha[:, None] * acc + dot(p.astype(v.dtype), v)
    return acc, m_new, l_new


def split_blocks(first_blk, end_blk, split, num_splits: int):
    """Blocks [b0, b1) of split ``split`` when [first_blk, end_blk) is cut into num_splits
    near-equal runs (split-K over the *actual* keys, not the padded block table)."""
    per = (jnp.maximum(end_blk - first_blk, 0) + num_splits - 1) // num_splits
    b0 = first_blk + split * per
    return b0, jnp.minimum(b0 + per, end_blk)


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge per-split normalised outputs o [S, ..., D] with their max m / sum l [S, ...]."""
    m_all = m.max(axis=0)
    w = l * jnp.exp(m - m_all[None])
    den = w.sum(axis=0)
    out = (w[..., None] * o).sum(axis=0)
    return out / jnp.where(den > 0, den, 1.0)[..., None]
