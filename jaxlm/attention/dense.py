"""Attention without a KV cache, for the pooling runner: bidirectional (encoders) or causal
(decoders as embedders), over a batch of rows padded to one length.

The model's layers call it exactly as they call a paged backend (``attn_backend(q, k, v,
kv_cache, md, scale=...)``); the cache argument is None and passed back untouched. The step's
T tokens are ``rows x seq_len`` (row r holds one prompt, padded after ``seq_lens[r]``), so one
prompt's queries see only its own keys: bidirectional attention is this mask alone, causal
adds ``key <= query``, a sliding window ``query - key < window``. Rows are sorted by length
before they are batched (``core/pooling_scheduler.py``), so padding stays small and the
[rows, heads, seq_len, seq_len] scores cost what each prompt's own square does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlm.attention.backends import FunctionBackend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseAttentionMetadata:
    # [R] real tokens of each row (0: a padding row).
    seq_lens: jax.Array
    # Static: the rows' padded length (T = rows * seq_len).
    seq_len: int = dataclasses.field(metadata=dict(static=True))
    # Static: causal (decoders) or bidirectional (encoders).
    causal: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache, md: DenseAttentionMetadata, *,
                    scale: float, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> tuple[jax.Array, None]:
    """q [T, Hq, D], k/v [T, Hkv, D] (T = rows * seq_len) -> ([T, Hq, D], kv_cache)."""
    R, L = md.num_rows, md.seq_len
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k.shape[1]
    G = Hq // Hkv
    qr = q.reshape(R, L, Hkv, G, D)
    kr = k.reshape(R, L, Hkv, D)
    vr = v.reshape(R, L, Hkv, D)
    s = jnp.einsum("rqhgd,rkhd->rhgqk", qr, kr, preferred_element_type=jnp.float32) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    kpos = jnp.arange(L)
    mask = kpos[None, :] < md.seq_lens[:, None]  # [R, K]
    mask = mask[:, None, :]  # [R, Q, K]
    qpos = kpos[:, None]
    if md.causal:
        mask = mask & (kpos[None, :] <= qpos)[None]
    if sliding_window is not None:
        mask = mask & ((qpos - kpos[None, :]) < sliding_window)[None]
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("rhgqk,rkhd->rqhgd", p, vr, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(R * L, Hq, D), kv_cache


DENSE_BACKEND = FunctionBackend("dense", dense_attention)
