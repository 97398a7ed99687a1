"""Engine configuration: one dataclass per concern, one module each, passed down explicitly
(vLLM's names and its ``vllm/config/`` layout).

These dataclasses are the one source of truth for every engine argument: a field whose
metadata has a ``help`` is an argument, and ``EngineArgs`` and the CLI flags are derived from
it (jaxlm.engine.arg_utils). Fields without help are filled by the engine, never given.
Light on purpose: importing this package must not import jax (the server's --help reads it).
"""

from jaxlm.config.cache import CacheConfig
from jaxlm.config.compilation import CompilationConfig
from jaxlm.config.engine import ARG_CONFIGS, EngineConfig, arg_fields
from jaxlm.config.load import LoadConfig
from jaxlm.config.lora import LoRAConfig
from jaxlm.config.model import ModelConfig
from jaxlm.config.observability import ObservabilityConfig
from jaxlm.config.parallel import ParallelConfig
from jaxlm.config.pooling import PoolingConfig
from jaxlm.config.scheduler import SchedulerConfig
from jaxlm.config.speculative import SpeculativeConfig
from jaxlm.config.utils import (
    ATTENTION_BACKENDS, DTYPE_ALIASES, DTYPES, LOAD_FORMATS, arg, human_readable_int, jaxlm_cache_root,
    parse_bytes, parse_int_list, parse_json_list, parse_json_object, parse_token_buckets)

__all__ = [
    "ARG_CONFIGS", "ATTENTION_BACKENDS", "CacheConfig", "CompilationConfig", "DTYPES", "DTYPE_ALIASES",
    "EngineConfig", "LOAD_FORMATS", "LoRAConfig", "LoadConfig", "ModelConfig", "ObservabilityConfig", "ParallelConfig", "PoolingConfig",
    "SchedulerConfig", "SpeculativeConfig", "arg", "arg_fields", "human_readable_int", "jaxlm_cache_root",
    "parse_bytes", "parse_int_list", "parse_json_list", "parse_json_object", "parse_token_buckets",
]
