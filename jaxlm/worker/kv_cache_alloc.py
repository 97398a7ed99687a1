"""The paged KV cache's device arrays: one [2, blocks, block_size, Hkv, D] array a layer, split
over the KV heads when tensor parallel divides them (else replicated)."""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxlm.attention.kv_quant import storage_dtype

logger = logging.getLogger(__name__)


def kv_sharding(mesh: jax.sharding.Mesh | None, num_kv_heads: int) -> jax.sharding.NamedSharding | None:
    """The cache's sharding on `mesh` (None without one): KV heads over "model" when it divides them."""
    if mesh is None:
        return None
    tp = mesh.shape.get("model", 1)
    spec = jax.sharding.PartitionSpec(None, None, None, "model" if num_kv_heads % tp == 0 and tp > 1 else None)
    return jax.sharding.NamedSharding(mesh, spec)


def allocate_kv_caches(spec: Any, num_blocks: int, block_size: int, dtype: Any,
                       sharding: jax.sharding.NamedSharding | None) -> list[jax.Array]:
    """Zeroed caches for `spec`'s layers; an fp8 cache is kept as its bytes (kv_quant.storage_dtype)
    and the attention layers know the format."""
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [jnp.zeros(shape, storage_dtype(dtype), device=sharding) for _ in range(spec.num_layers)]
    logger.info("KV cache: %d blocks x %d tokens, %d layers, %s",
                num_blocks, block_size, spec.num_layers, jnp.dtype(dtype).name)
    return caches
