"""Pure-JAX references for the kernels in this package (dense gather + masked softmax).

Deliberately simple and slow: gather every page of the row, mask, softmax. These are the
oracles of ``tests/kernels_pallas``; they take the same arguments as the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_decode_reference(
    q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, token_rows: jax.Array,
    kv_lens: jax.Array, *, scale: float, sliding_window: int | None = None,
    logits_soft_cap: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
) -> jax.Array:
    """Token t attends to keys [0, kv_lens[t]) of row token_rows[t] (window ends at kv_len-1).
    An fp8 cache is read as stored value x ``k_scale`` / ``v_scale`` (1 when None)."""
    T, Hq, D = q.shape
    _, num_blocks, bs, Hkv, _ = kv_cache.shape
    G = Hq // Hkv
    pages = jnp.clip(block_tables[token_rows], 0, num_blocks - 1)  # [T, P]
    k = kv_cache[0][pages].reshape(T, -1, Hkv, D).astype(jnp.float32)  # [T, S, Hkv, D]
    v = kv_cache[1][pages].reshape(T, -1, Hkv, D).astype(jnp.float32)
    k = k if k_scale is None else k * k_scale
    v = v if v_scale is None else v * v_scale
    j = jnp.arange(k.shape[1])
    mask = j[None, :] < kv_lens[:, None]
    if sliding_window is not None:
        mask &= j[None, :] >= kv_lens[:, None] - sliding_window
    k = jnp.where(mask[:, :, None, None], k, 0.0)  # garbage (NaN) must not leak
    v = jnp.where(mask[:, :, None, None], v, 0.0)
    qf = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    s = jnp.einsum("thgd,tshd->thgs", qf, k, precision="highest") * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    den = p.sum(-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)  # padding tokens (no keys) -> 0
    out = jnp.einsum("thgs,tshd->thgd", p, v, precision="highest")
    return out.reshape(T, Hq, D).astype(q.dtype)


def ragged_token_layout(context_lens: jax.Array, query_start_loc: jax.Array, num_tokens: int):
    """Per flat token: (row, kv_len = position + 1), with kv_len 0 for tokens outside all rows."""
    t = jnp.arange(num_tokens)
    row = jnp.searchsorted(query_start_loc, t, side="right") - 1
    num_rows = context_lens.shape[0]
    valid = (t < query_start_loc[-1]) & (row >= 0) & (row < num_rows)
    row = jnp.clip(row, 0, num_rows - 1)
    pos = context_lens[row] + (t - query_start_loc[row])
    return row.astype(jnp.int32), jnp.where(valid, pos + 1, 0).astype(jnp.int32)


def ragged_paged_reference(
    q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, context_lens: jax.Array,
    query_start_loc: jax.Array, *, scale: float, sliding_window: int | None = None,
    logits_soft_cap: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
) -> jax.Array:
    """Ragged chunks: token i of row r sits at position context_lens[r] + i and attends to
    keys [0, position] of its row (cached context + causal within the chunk)."""
    rows, kv_lens = ragged_token_layout(context_lens, query_start_loc, q.shape[0])
    return paged_decode_reference(q, kv_cache, block_tables, rows, kv_lens, scale=scale,
                                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                  k_scale=k_scale, v_scale=v_scale)


def _stored(x: jax.Array, dtype, scale: float | None) -> jax.Array:
    """x as a cache of ``dtype`` stores it: fp8 (1-byte floats) as x / scale, saturated."""
    if jnp.dtype(dtype).itemsize == 1:
        fmax = float(jnp.finfo(dtype).max)
        return jnp.clip(x.astype(jnp.float32) / (1.0 if scale is None else scale), -fmax, fmax).astype(dtype)
    return x.astype(dtype)


def write_kv_reference(kv_cache: jax.Array, k: jax.Array, v: jax.Array,
                       slot_mapping: jax.Array, k_scale: float | None = None,
                       v_scale: float | None = None) -> jax.Array:
    """Scatter k/v [T, Hkv, D] into flat slots; slot -1 (padding) writes nothing."""
    two, nb, bs, h, d = kv_cache.shape
    flat = kv_cache.reshape(two, nb * bs, h, d)
    slots = jnp.where(slot_mapping < 0, nb * bs, slot_mapping)
    flat = flat.at[0, slots].set(_stored(k, flat.dtype, k_scale), mode="drop")
    flat = flat.at[1, slots].set(_stored(v, flat.dtype, v_scale), mode="drop")
    return flat.reshape(kv_cache.shape)
