"""Attention under tensor parallel: each device runs the backend on its own heads.

The q/k/v projections are column-split over the mesh's ``model`` axis, so device i holds query
heads [i*Hq/tp, (i+1)*Hq/tp) and the KV heads those need; the KV cache is split over KV heads
the same way. ``jax.shard_map`` hands the backend (the XLA function or the Pallas kernels)
its local heads and local cache, so no device reads another's heads and the kernels see
ordinary single-device shapes. The attention metadata is replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.models.utils import MODEL_AXIS

# [T, H, D] split on heads; the cache [2, blocks, block_size, Hkv, D] on KV heads.
_HEADS = P(None, MODEL_AXIS, None)
_CACHE = P(None, None, None, MODEL_AXIS, None)


@dataclasses.dataclass(frozen=True)
class HeadShardedBackend:
    """``backend`` run per device over ``mesh``'s ``model`` axis (an AttentionBackend too)."""

    backend: Any
    mesh: Mesh | AbstractMesh  # abstract: lowering without the devices (export)

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def kv_quant(self) -> Any:
        return self.backend.kv_quant

    def constraints(self, block_size: int, head_dim: int) -> Any:
        return self.backend.constraints(block_size, head_dim)

    def __call__(self, q, k, v, kv_cache, md: AttentionMetadata, **kw):
        # The fp8 scales are arrays (per-tensor, replicated): explicit inputs of the shard_map.
        scales = {n: kw.pop(n) for n in ("k_scale", "v_scale") if kw.get(n) is not None}

        def local(q, k, v, kv_cache, md, scales):
            return self.backend(q, k, v, kv_cache, md, **kw, **scales)

        md_spec = jax.tree.map(lambda _: P(), md)
        return jax.shard_map(
            local, mesh=self.mesh,
            in_specs=(_HEADS, _HEADS, _HEADS, _CACHE, md_spec, jax.tree.map(lambda _: P(), scales)),
            out_specs=(_HEADS, _CACHE), check_vma=False,
        )(q, k, v, kv_cache, md, scales)


def shard_attention_backend(backend: Any, mesh: Mesh | AbstractMesh | None) -> Any:
    """The backend wrapped for ``mesh`` when it splits heads (model axis > 1), else as is."""
    if mesh is None or mesh.shape.get(MODEL_AXIS, 1) == 1:
        return backend
    return HeadShardedBackend(backend, mesh)
