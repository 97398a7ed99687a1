"""Engine configuration: one dataclass per concern, passed down explicitly (vLLM's names)."""

from __future__ import annotations

import dataclasses
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "orbax")


@dataclasses.dataclass
class ModelConfig:
    # Path to an HF model directory, a .gguf file, or an orbax checkpoint; None = default model.
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: list[str] | None = None
    # Default sampling: "auto" = the model's generation_config.json, "vllm" = SamplingParams'
    # defaults, or a directory holding a generation_config.json (vLLM's --generation-config).
    generation_config: str = "auto"
    # Overrides on top of the generation config (vLLM's --override-generation-config).
    override_generation_config: dict[str, Any] | None = None
    # Most logprobs a request may ask for (vLLM's --max-logprobs).
    max_logprobs: int = 20
    # Filled by jaxlm.model_loader.resolve_model_config(): the transformers config.
    hf_config: Any = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"Unknown dtype {self.dtype!r}; choose one of {', '.join(_DTYPES)}")


@dataclasses.dataclass
class LoadConfig:
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(
                f"Unknown load format {self.load_format!r}; choose one of {', '.join(_LOAD_FORMATS)}"
            )


@dataclasses.dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # Bytes for the KV cache; overrides gpu_memory_utilization when set.
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Filled by the worker once the cache is sized.
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclasses.dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    # Requests allowed in the waiting queue before new ones are refused (server: HTTP 429).
    max_num_queued_reqs: int | None = None


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1


@dataclasses.dataclass
class CompilationConfig:
    # Padded sizes of the flat token batch of one step; None = powers of two up to the budget.
    token_buckets: list[int] | None = None
    # Padded numbers of sequences sampled in one step; None = powers of two up to max_num_seqs.
    seq_buckets: list[int] | None = None
    # JAX persistent compilation cache; None = ~/.cache/jaxlm/xla, "" = off.
    compilation_cache_dir: str | None = None


@dataclasses.dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    load_config: LoadConfig
    compilation_config: CompilationConfig
    attention_backend: str = "auto"
