"""Worker.determine_num_available_blocks: the KV cache's size from the cache flags, on a stub
replica (the sizing reads only the bytes per block and the device's memory)."""

from __future__ import annotations

import types

import numpy as np

from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.worker import worker as worker_module
from jaxlm.worker.worker import Worker

PER_BLOCK = 1000


def _worker(memory_stats: dict, **engine_kw) -> Worker:
    w = Worker(EngineArgs(model="m", max_model_len=64, **engine_kw).create_engine_config(),
               mesh=types.SimpleNamespace(devices=np.array([types.SimpleNamespace(memory_stats=lambda: memory_stats)])))
    w.dtype = np.float32
    spec = types.SimpleNamespace(bytes_per_block=lambda block_size, itemsize: PER_BLOCK)
    w.model_runner = types.SimpleNamespace(kv_cache_spec=spec, kv_cache_shards=lambda: 1)
    return w


def test_kv_cache_budget_flags(monkeypatch):
    gpu = {"bytes_limit": 10_000_000, "bytes_in_use": 1_000_000}
    # --kv-cache-memory-bytes: that many bytes, whatever the device.
    assert _worker(gpu, kv_cache_memory_bytes=1_000_000).determine_num_available_blocks() == 1000
    assert _worker(gpu, kv_cache_memory_bytes=250_000).determine_num_available_blocks() == 250
    # --gpu-memory-utilization: the fraction of an accelerator's memory for weights + KV cache
    # (on CPU, which has no device memory to measure, the cache is sized from RAM instead).
    monkeypatch.setattr(worker_module.jax, "default_backend", lambda: "gpu")
    assert _worker(gpu).determine_num_available_blocks() == 8000  # 0.9 x 10 MB - 1 MB in use
    assert _worker(gpu, gpu_memory_utilization=0.5).determine_num_available_blocks() == 4000
    assert _worker(gpu, num_gpu_blocks_override=7, gpu_memory_utilization=0.5).determine_num_available_blocks() == 7
