"""Worker: owns one model replica on a mesh — loads it, sizes the KV cache, runs steps."""

from __future__ import annotations

from typing import Any

import logging

import jax
import numpy as np
import psutil

from jaxlm.attention.backends import get_attention_backend
from jaxlm.attention.sharded import shard_attention_backend
from jaxlm.config import EngineConfig
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.model_loader import get_jax_dtype, get_model
from jaxlm.models.utils import STAGE_AXIS, stage_mesh
from jaxlm.worker.model_runner import ModelRunner
from jaxlm.worker.pipeline_runner import PipelineModelRunner

# CPU has no device memory to measure: the KV cache defaults to this much RAM (vLLM's CPU
# backend default too), capped by half the free RAM and by what the limits can ever use.
_CPU_DEFAULT_KV_BYTES = 4 << 30
# Free RAM drifts between starts; a KV cache sized from it exactly would change shape each time,
# and a new shape is a new program for every compile cache. Kept to this many significant bits.
_CPU_RAM_BUDGET_BITS = 2

logger = logging.getLogger(__name__)


def round_down_significant_bits(n: int, bits: int) -> int:
    """n with all but its `bits` leading binary digits cleared (7 -> 6, 5 -> 4 for bits=2)."""
    drop = max(int(n).bit_length() - bits, 0)
    return (int(n) >> drop) << drop


def log_model_weights(model: Any, model_config: Any) -> None:
    """The start-up line on the served model's weights, and their bytes kept for /metrics."""
    from jaxlm.models.quantization.params import model_weight_bytes

    model_config.weight_bytes = model_weight_bytes(model)
    quant = getattr(model, "quant_config", None)
    logger.info("model weights: %.2f MiB, quantization: %s", model_config.weight_bytes / 2**20,
                quant.describe() if quant is not None else "none")


class Worker:
    def __init__(self, config: EngineConfig, mesh: jax.sharding.Mesh):
        self.config = config
        self.mesh = mesh
        self.model_runner: ModelRunner | None = None

    def load_model(self) -> None:
        # Under tensor parallel each device attends over its own heads. Under pipeline parallel
        # every stage's sub-mesh has the same shape: its abstract mesh serves all stages.
        pipeline = self.mesh.shape.get(STAGE_AXIS, 1) > 1
        head_mesh = stage_mesh(self.mesh, 0).abstract_mesh if pipeline else self.mesh
        backend = shard_attention_backend(get_attention_backend(self.config.attention_backend), head_mesh)
        self.dtype = get_jax_dtype(self.config.model_config)
        model = get_model(
            self.config.model_config, self.config.load_config, attn_backend=backend, mesh=self.mesh,
            enable_expert_parallel=self.config.parallel_config.enable_expert_parallel,
        )
        log_model_weights(model, self.config.model_config)
        if self.config.speculative_config is not None:  # the verify step's runner, the draft model
            from jaxlm.spec_decode.setup import build_spec_runner

            self.model_runner = build_spec_runner(self.config, model, self.mesh, backend)
            return
        runner_cls = PipelineModelRunner if pipeline else ModelRunner
        self.model_runner = runner_cls(self.config, model, self.mesh)

    def bytes_per_block(self) -> int:
        runner = self.model_runner
        specs = [runner.kv_cache_spec] + [r.kv_cache_spec for r in [getattr(runner, "drafter", None)] if r is not None]
        return sum(s.bytes_per_block(self.config.cache_config.block_size, np.dtype(self.dtype).itemsize)
                   for s in specs)

    def determine_num_available_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.bytes_per_block()
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif jax.default_backend() == "cpu":
            sched = self.config.scheduler_config
            useful = (sched.max_num_seqs * -(-sched.max_model_len // cache.block_size) + 1) * per_block
            free_half = psutil.virtual_memory().available // 2
            ram_budget = round_down_significant_bits(free_half, _CPU_RAM_BUDGET_BITS)
            budget = min(_CPU_DEFAULT_KV_BYTES, ram_budget, useful)
            if ram_budget < min(_CPU_DEFAULT_KV_BYTES, useful):
                logger.info("CPU KV cache: half the free RAM (%.2f GiB) rounded down to %.2f GiB, so that a restart "
                            "gets the same cache shape and reuses its compiled programs", free_half / 2**30,
                            ram_budget / 2**30)
        else:
            # Measured per device, so sized by what one device holds of a block (its KV heads).
            stats = self.mesh.devices.flat[0].memory_stats() or {}
            limit = stats.get("bytes_limit", 0) * cache.gpu_memory_utilization
            budget = int(limit - stats.get("bytes_in_use", 0))
            per_block //= self.model_runner.kv_cache_shards()
        num_blocks = int(budget // per_block)
        if num_blocks <= 0:
            raise ValueError(
                f"No memory left for the KV cache (budget {budget} bytes, {per_block} bytes per block): "
                "raise --gpu-memory-utilization or --kv-cache-memory-bytes"
            )
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, self.dtype)

    def compile_or_warm_up_model(self) -> None:
        self.model_runner.warm_up()

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        if non_block:
            return self.model_runner.execute_model(scheduler_output, non_block=True)
        return self.model_runner.execute_model(scheduler_output)  # the one-argument call wrappers expect
