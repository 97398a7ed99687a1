"""Worker.determine_num_available_blocks: the KV cache's size from the cache flags, on a stub
replica (the sizing reads only the bytes per block and the device's memory)."""

from __future__ import annotations

import types

import numpy as np

from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.worker import worker as worker_module
from jaxlm.worker.worker import Worker

PER_BLOCK = 1000


def _worker(memory_stats: dict, per_block: int = PER_BLOCK, **engine_kw) -> Worker:
    engine_kw.setdefault("max_model_len", 64)
    w = Worker(EngineArgs(model="m", **engine_kw).create_engine_config(),
               mesh=types.SimpleNamespace(devices=np.array([types.SimpleNamespace(memory_stats=lambda: memory_stats)])))
    w.dtype = np.float32
    spec = types.SimpleNamespace(bytes_per_block=lambda block_size, itemsize: per_block)
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


def test_cpu_kv_cache_from_free_ram_is_coarse(monkeypatch, caplog):
    """On CPU the cache is capped by half the free RAM, which drifts between starts: the budget keeps
    2 significant bits, so nearby readings size the same cache (the same compiled programs)."""
    monkeypatch.setattr(worker_module.jax, "default_backend", lambda: "cpu")
    per_block = 1 << 20  # 1 MiB; 256 seqs x 2048 tokens could use 32 GiB, so RAM is the binding cap
    readings = iter([])

    def reading():
        return types.SimpleNamespace(available=next(readings))

    monkeypatch.setattr(worker_module.psutil, "virtual_memory", reading)

    def blocks(available_gib: float, **kw) -> int:
        nonlocal readings
        readings = iter([int(available_gib * 2**30)])
        return _worker({}, per_block, max_model_len=2048, max_num_seqs=256, **kw).determine_num_available_blocks()

    with caplog.at_level("INFO", logger=worker_module.__name__):
        first, second = blocks(5.2), blocks(5.9)  # half of each: 2.6 and 2.95 GiB, both 0b10.x GiB
    assert first == second == 2048  # 2 GiB of 1 MiB blocks
    assert "rounded down to 2.00 GiB" in caplog.text
    assert blocks(7.0) == 3072  # 3.5 GiB -> 3 GiB (0b11.1 -> 0b11)
    assert blocks(20.0) == 4096  # above the 4 GiB default the default holds, as before
    assert blocks(5.2, num_gpu_blocks_override=5) == 5  # the override still wins
