"""The pooler inside the compiled step (vLLM's ``Pooler``): the rows' hidden states [R, L, H]
-> one vector per row (CLS, MEAN, LAST) or every token (ALL), then the model's head (a
classifier; identity for an embedding model). Per-request options (dimensions, normalize,
activation) are applied on the host afterwards (``postprocess``), so one program serves them all."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pool_hidden(hidden: jax.Array, seq_lens: jax.Array, pooling_type: str) -> jax.Array:
    """hidden [R, L, H], seq_lens [R] -> [R, H] (ALL: [R, L, H]), in float32."""
    h = hidden.astype(jnp.float32)
    if pooling_type == "CLS":
        return h[:, 0]
    if pooling_type == "LAST":
        last = jnp.maximum(seq_lens - 1, 0)
        return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    if pooling_type == "MEAN":
        mask = (jnp.arange(h.shape[1])[None, :] < seq_lens[:, None]).astype(h.dtype)
        total = jnp.einsum("rl,rlh->rh", mask, h)
        return total / jnp.maximum(seq_lens, 1).astype(h.dtype)[:, None]
    if pooling_type == "ALL":
        return h
    raise ValueError(f"Unknown pooling type {pooling_type!r}")
