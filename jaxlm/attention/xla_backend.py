"""Paged attention in plain jax.numpy: runs on every device, and is the oracle for kernels.

Attention for a step is split in two parts merged with an online softmax:
  * in-step: the step's own tokens attend to each other (same row, causal) straight from
    the new K/V, so a fresh prefill never touches the cache;
  * cached context: each token attends to its row's ``context_lens`` cached tokens, read
    through the block table in chunks of pages; only the leading blocks of tokens whose rows
    have context run, with trip counts set by the longest context in each block.
Both paths read only valid positions, so garbage in unused pages never leaks in.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlm.attention.metadata import AttentionMetadata

_NEG_INF = -1e30
# Tokens of context read per loop iteration (rounded to whole pages).
_CHUNK_TOKENS = 128
# Query tokens per block of the cached-context loop.
_TOKEN_BLOCK = 16


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new K/V ([T, Hkv, D]) into kv_cache [2, num_blocks, block_size, Hkv, D]."""
    _, nb, bs, _, _ = kv_cache.shape
    # Index (block, offset) on the 5-D array: XLA scatters in place into the donated cache
    # (a flattening reshape first made it copy the whole cache every layer).
    block = jnp.where(slot_mapping < 0, nb, slot_mapping // bs)  # out of range -> dropped
    offset = slot_mapping % bs
    kv_cache = kv_cache.at[0, block, offset].set(k.astype(kv_cache.dtype), mode="drop")
    return kv_cache.at[1, block, offset].set(v.astype(kv_cache.dtype), mode="drop")


def _scores(s: jax.Array, scale: float, logits_soft_cap: float | None) -> jax.Array:
    s = s * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    return s


def _merge(m, l, acc, s, mask, v, v_spec):
    """One online-softmax update; s/mask [T, Hkv, G, K], v [.., K, Hkv, D] per v_spec."""
    s = jnp.where(mask, s, _NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l_new = alpha * l + p.sum(axis=-1)
    acc_new = alpha[..., None] * acc + jnp.einsum(v_spec, p, v)
    return m_new, l_new, acc_new


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
) -> tuple[jax.Array, jax.Array]:
    """q [T, Hq, D], k/v [T, Hkv, D] (this step's tokens) -> (out [T, Hq, D], new kv_cache)."""
    T, Hq, D = q.shape
    Hkv = kv_cache.shape[3]
    kv_cache = write_kv(kv_cache, k, v, md.slot_mapping)
    qf = q.astype(jnp.float32).reshape(T, Hkv, Hq // Hkv, D)
    carry = _attend_in_step(qf, k, v, md, scale, sliding_window, logits_soft_cap)
    m, l, acc = _attend_cached(qf, kv_cache, md, carry, scale, sliding_window, logits_soft_cap)
    out = acc / l[..., None]
    return out.reshape(T, Hq, D).astype(q.dtype), kv_cache


def _attend_in_step(qf, k, v, md: AttentionMetadata, scale, sliding_window, logits_soft_cap):
    """The step's tokens attend to each other (same row, causal) from the new K/V; returns
    the online-softmax state (m, l [T, Hkv, G], acc [T, Hkv, G, D])."""
    T, Hkv, G, D = qf.shape
    pos, req = md.positions, md.token_to_req
    s = _scores(jnp.einsum("thgd,shd->thgs", qf, k.astype(jnp.float32)), scale, logits_soft_cap)
    eye = jnp.eye(T, dtype=bool)
    key_valid = (md.slot_mapping >= 0)[None, :] | eye
    mask = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None]) & key_valid
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    mask = mask[:, None, None, :]
    m = jnp.full((T, Hkv, G), _NEG_INF, jnp.float32)
    l = jnp.zeros((T, Hkv, G), jnp.float32)
    acc = jnp.zeros((T, Hkv, G, D), jnp.float32)
    return _merge(m, l, acc, s, mask, v.astype(jnp.float32), "thgs,shd->thgd")


def _attend_cached(qf, kv_cache, md: AttentionMetadata, carry, scale, sliding_window, logits_soft_cap):
    """Each token attends to its row's ``context_lens`` cached tokens, merged into `carry`.

    Only the leading tokens whose row has context run (the runner puts those rows first, so a
    fresh prefill beside decodes reads no pages), Bt tokens at a time, each block reading its
    rows' pages chunk by chunk.
    """
    T, Hkv, _, D = qf.shape
    bs = kv_cache.shape[2]
    pos = md.positions
    ctx = md.context_lens[md.token_to_req]  # [T]
    bt = md.block_tables[md.token_to_req]  # [T, P]
    pages_per_chunk = max(1, min(bt.shape[1], _CHUNK_TOKENS // bs))
    pad = (-bt.shape[1]) % pages_per_chunk
    if pad:
        bt = jnp.pad(bt, ((0, 0), (0, pad)))
    chunk = pages_per_chunk * bs
    # A small odd bucket (a speculative verify step of 1 + k tokens) is one block, not T blocks
    # of one token: SmolLM2's 5-token body 85 -> 78 ms (min of 15, busy host).
    Bt = T if T <= _TOKEN_BLOCK else math.gcd(T, _TOKEN_BLOCK)
    n_ctx_tokens = jnp.max(jnp.where(ctx > 0, jnp.arange(1, T + 1), 0))

    def token_block(b, carry):
        m, l, acc = carry
        start = b * Bt
        take = lambda x: lax.dynamic_slice_in_dim(x, start, Bt, axis=0)  # noqa: E731
        q_b, bt_b, ctx_b, pos_b = take(qf), take(bt), take(ctx), take(pos)

        def page_chunk(i, inner):
            m_b, l_b, acc_b = inner
            pages = lax.dynamic_slice_in_dim(bt_b, i * pages_per_chunk, pages_per_chunk, axis=1)
            kc = kv_cache[0, pages].reshape(Bt, chunk, Hkv, D).astype(jnp.float32)
            vc = kv_cache[1, pages].reshape(Bt, chunk, Hkv, D).astype(jnp.float32)
            s = _scores(jnp.einsum("thgd,tjhd->thgj", q_b, kc), scale, logits_soft_cap)
            j = i * chunk + jnp.arange(chunk)
            mask = j[None, :] < ctx_b[:, None]
            if sliding_window is not None:
                mask &= j[None, :] > pos_b[:, None] - sliding_window
            # Zero V outside the mask: p = 0 times garbage (NaN/inf in an unused page) is NaN.
            vc = jnp.where(mask[:, :, None, None], vc, 0.0)
            return _merge(m_b, l_b, acc_b, s, mask[:, None, None, :], vc, "thgj,tjhd->thgd")

        n_chunks = (jnp.max(ctx_b) + chunk - 1) // chunk
        m_b, l_b, acc_b = lax.fori_loop(0, n_chunks, page_chunk, (take(m), take(l), take(acc)))
        put = lambda x, y: lax.dynamic_update_slice_in_dim(x, y, start, axis=0)  # noqa: E731
        return put(m, m_b), put(l, l_b), put(acc, acc_b)

    return lax.fori_loop(0, (n_ctx_tokens + Bt - 1) // Bt, token_block, carry)
