"""Attention under tensor parallel: the backend runs per device on its own heads (shard_map).

The numbers under TP are checked end to end on 8 CPU devices (tests/executor/test_mesh_executor.py);
here the Pallas kernels under shard_map lower for CUDA on CPU (an abstract 2-device mesh: no
devices needed) and each device's kernel is the one-device kernel over half the heads.
"""

from __future__ import annotations

import functools
import re

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from jaxlm.attention.backends import get_attention_backend
from jaxlm.attention.pallas_backend import PallasBackend, PallasConstraints
from jaxlm.attention.sharded import HeadShardedBackend, shard_attention_backend
from tests.kernels_pallas.test_export_cuda import TRITON_TARGETS, _specs, export_cuda

_GRID = re.compile(r"grid_x = \d+ : i32, grid_y = \d+ : i32, grid_z = \d+ : i32")


def _kernel_grid(backend, hq, hkv, decode):
    d, bs = 128, 16
    P = PallasConstraints.for_cache(bs, d).round_pages(2048 // bs)
    fn = functools.partial(backend, scale=d ** -0.5, max_query_len=1 if decode else None)
    text = export_cuda(fn, *_specs(16, 16, P, hq, hkv, d, bs, jnp.bfloat16)).mlir_module()
    assert sum(text.count(t) for t in TRITON_TARGETS) == 1, "expected exactly one kernel"
    return _GRID.findall(text)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
def test_pallas_under_shard_map_lowers_for_cuda_on_local_heads(decode):
    mesh = AbstractMesh((1, 2), ("data", "model"))
    sharded = _kernel_grid(HeadShardedBackend(PallasBackend(interpret=False), mesh), 16, 4, decode)
    local = _kernel_grid(PallasBackend(interpret=False), 8, 2, decode)
    assert sharded and sharded == local


def test_wrapped_only_when_heads_are_split():
    xla = get_attention_backend("xla")
    assert shard_attention_backend(xla, None) is xla
    assert shard_attention_backend(xla, AbstractMesh((1, 1), ("data", "model"))) is xla
    wrapped = shard_attention_backend(xla, AbstractMesh((1, 2), ("data", "model")))
    assert isinstance(wrapped, HeadShardedBackend) and wrapped.name == "xla"
    assert wrapped.constraints(16, 64) is None  # the XLA backend's: no decode programs


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
def test_fp8_cache_under_shard_map_lowers_for_cuda(decode):
    """--kv-cache-dtype fp8 under tensor parallel: the per-tensor scales enter the shard_map as
    replicated inputs, each device writes and reads its heads' bytes."""
    import jax

    mesh = AbstractMesh((1, 2), ("data", "model"))
    d, bs = 128, 16
    P = PallasConstraints.for_cache(bs, d).round_pages(2048 // bs)
    q, k, v, cache, md = _specs(16, 16, P, 16, 4, d, bs, jnp.bfloat16)
    cache = jax.ShapeDtypeStruct(cache.shape, jnp.uint8)  # the engine keeps fp8 as bytes
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    backend = HeadShardedBackend(PallasBackend(interpret=False), mesh)

    def fn(q, k, v, cache, md, ks, vs):
        return backend(q, k, v, cache, md, scale=d ** -0.5, max_query_len=1 if decode else None,
                       k_scale=ks, v_scale=vs, cache_dtype=jnp.float8_e4m3fn)

    exp = export_cuda(fn, q, k, v, cache, md, scale, scale)
    assert sum(exp.mlir_module().count(t) for t in TRITON_TARGETS) == 1
    assert exp.out_avals[1].dtype == jnp.uint8
