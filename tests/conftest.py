"""Suite-wide settings.

- XLA's backend runs without LLVM's optimizations: the suite compiles thousands of tiny programs
  that each run for milliseconds, and -O0 cuts their compile CPU by about a quarter. The HLO,
  hence the results, are the same; set XLA_FLAGS yourself to run the suite at another level.
- The process keeps the environment it started with: test modules import helpers that run as
  their own 8-device processes, and those must not change XLA_FLAGS for everything after.
- The slowest files run first, so that two workers (`-n 2`, each file on one worker) end together.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.suite_env import XLA_FLAGS_AT_START

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"

# Each file's wall time, slowest first (a full serial run, docs/PERF_NOTES.md session 11): 8-device
# subprocesses, real-model engines, servers. Files not listed keep their collection order after these.
SLOWEST_FIRST = [
    "tests/executor/test_mesh_executor.py",
    "tests/entrypoints/test_kv_fp8_accuracy.py",
    "tests/engine/test_llm_engine_parity.py",
    "tests/executor/test_multihost_executor.py",
    "tests/serve/test_engine_core_proc.py",
    "tests/executor/test_pipeline_parallel.py",
    "tests/attention/test_backend_e2e.py",
    "tests/serve/test_deferred_programs.py",
    "tests/models/test_dense_families_engine.py",
    "tests/entrypoints/test_llm_embed.py",
    "tests/models/test_moe_parallel.py",
    "tests/model_loader/test_loader_default_model.py",
    "tests/scripts/test_bench_smoke.py",
    "tests/benchmarks/test_bench_cli.py",
    "tests/entrypoints/test_smollm2.py",
    "tests/models/test_llama_family.py",
    "tests/serve/test_pooling_server.py",
    "tests/models/quantization/test_quantized_tp.py",
    "tests/model_loader/test_gguf_blocks.py",
    "tests/serve/test_program_cache_restart.py",
    "tests/models/quantization/test_quantized_engine.py",
    "tests/lora/test_lora_tp.py",
    "tests/models/test_moe_engine.py",
    "tests/models/test_qwen2_5_vl.py",
    "tests/models/test_llava.py",
    "tests/models/test_gemma3_vision.py",
    "tests/serve/test_llava_server.py",
    "tests/serve/test_qwen2_5_vl_server.py",
]


def pytest_configure(config: pytest.Config) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {TEST_XLA_FLAGS}".strip()
    config.stash[XLA_FLAGS_AT_START] = os.environ["XLA_FLAGS"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
