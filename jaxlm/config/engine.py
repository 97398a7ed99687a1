"""EngineConfig: all configs of one engine, and the list the CLI is generated from."""

from __future__ import annotations

import dataclasses

from jaxlm.config.cache import CacheConfig
from jaxlm.config.compilation import CompilationConfig
from jaxlm.config.load import LoadConfig
from jaxlm.config.lora import LoRAConfig
from jaxlm.config.model import ModelConfig
from jaxlm.config.observability import ObservabilityConfig
from jaxlm.config.parallel import ParallelConfig
from jaxlm.config.pooling import PoolingConfig
from jaxlm.config.scheduler import SchedulerConfig
from jaxlm.config.speculative import SpeculativeConfig
from jaxlm.config.utils import ATTENTION_BACKENDS, arg, parse_json_object


@dataclasses.dataclass
class EngineConfig:
    """All configs of one engine (plus the attention backend)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    load_config: LoadConfig
    compilation_config: CompilationConfig
    attention_backend: str = arg("auto", "attention kernels (auto: pallas on GPU; on CPU cpu, the XLA path with a C++ "
                                 "decode kernel built on first use, or xla when no C++ compiler is found)",
                                 choices=ATTENTION_BACKENDS)
    observability_config: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)
    lora_config: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    pooling_config: PoolingConfig = dataclasses.field(default_factory=PoolingConfig)
    speculative_config: SpeculativeConfig | None = arg(
        None, "speculative decoding, vLLM's JSON object, e.g. '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4}' (methods ngram, draft_model)", parse=parse_json_object)

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.lora_config.enable_lora and self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("enable_lora with pipeline_parallel_size > 1 is not supported yet")


# Every config that holds engine arguments, in --help order (one argument group each).
ARG_CONFIGS: tuple[type, ...] = (ModelConfig, LoadConfig, CacheConfig, SchedulerConfig, ParallelConfig,
                                 CompilationConfig, LoRAConfig, ObservabilityConfig, PoolingConfig,
                                 EngineConfig)


def arg_fields(config_cls: type) -> list[dataclasses.Field]:
    """The fields of ``config_cls`` that are engine arguments (those with help text)."""
    return [f for f in dataclasses.fields(config_cls) if f.metadata.get("help")]
