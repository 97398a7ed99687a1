"""Engine configuration: one dataclass per concern, passed down explicitly (vLLM's names).

These dataclasses are the one source of truth for every engine argument: a field whose
metadata has a ``help`` is an argument, and ``EngineArgs`` and the CLI flags are derived from
it (jaxlm.engine.arg_utils). Fields without help are filled by the engine, never given.
Light on purpose: importing this module must not import jax (the server's --help reads it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any, Callable

logger = logging.getLogger(__name__)

# Canonical dtypes, then vLLM's aliases for them.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ("auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "orbax")
ATTENTION_BACKENDS = ("auto", "xla", "pallas")


def jaxlm_cache_root() -> str | None:
    """The one cache root: $JAXLM_CACHE_DIR ("" = no caches), else $XDG_CACHE_HOME/jaxlm,
    else ~/.cache/jaxlm. The compilation cache (``xla/``) and GGUF tokenizers live under it."""
    root = os.environ.get("JAXLM_CACHE_DIR")
    if root is not None:
        return root or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxlm")


# ---- parsers for CLI values (vLLM's spellings) ---------------------------------------------

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """``32k`` = 32000, ``32K`` = 32768 (lower case decimal, upper case binary, as vLLM)."""
    text = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if not match:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer (suffixes: k/m/g = 10^3.., K/M/G = 2^10..)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ValueError(f"{text!r}: no decimals with binary suffixes like {suffix}; "
                         f"did you mean {number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


def parse_bytes(text: str) -> int:
    """A byte count: ``4000000000``, ``1e9``, ``4GiB``/``4G`` (binary), ``4GB``/``4g`` (decimal)."""
    text = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?(?:[eE]\d+)?)\s*([kKmMgGtT])?(i?[bB])?", text)
    if not match:
        raise ValueError(f"{text!r} is not a byte count (e.g. 4000000000, 1e9, 4GiB, 4GB)")
    number, suffix, unit = match.groups()
    if suffix is None:
        value = float(number)
        if value != int(value):
            raise ValueError(f"{text!r} is not a whole number of bytes")
        return int(value)
    if unit is None:  # bare suffix: vLLM's human_readable_int
        return human_readable_int(number + suffix)
    scale = _BINARY[suffix.upper()] if unit.lower() == "ib" else _DECIMAL[suffix.lower()]
    return int(float(number) * scale)


def parse_int_list(text: str) -> list[int]:
    """``16,32,64`` → [16, 32, 64]."""
    return [int(x) for x in str(text).split(",") if x.strip()]


def parse_token_buckets(text: str) -> list[int] | str:
    """``16,32,64`` → [16, 32, 64]; ``auto`` stays "auto" (derived from --workload at start-up)."""
    return "auto" if str(text).strip() == "auto" else parse_int_list(text)


def parse_json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def parse_json_list(text: str) -> list[Any]:
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError(f"expected a JSON list, got {text!r}")
    return value


def arg(default: Any = None, help: str = "", *, choices: tuple[str, ...] | None = None,
        parse: Callable[[str], Any] | None = None, flags: tuple[str, ...] = (),
        nargs: str | None = None) -> Any:
    """A config field that is also an engine argument (``--field-name`` plus ``flags``)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "parse": parse, "flags": flags, "nargs": nargs})


# ---- the configs -----------------------------------------------------------------------------


@dataclasses.dataclass
class ModelConfig:
    """Which model and tokenizer, in which dtype, and its request limits."""

    model: str | None = arg(None, "HF model directory, .gguf file or orbax checkpoint "
                                  "(default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = arg(None, "tokenizer directory (default: the model's)")
    revision: str | None = arg(None, "revision (branch, tag or commit) of an org/name model in the local HF cache")
    trust_remote_code: bool = arg(False, "accepted for vLLM scripts; jaxlm never runs a model's remote code "
                                         "(its own model classes and HF fast tokenizers only)")
    dtype: str = arg("auto", "weights and activations dtype (auto: float32 on CPU, the checkpoint's on GPU; "
                             "half = float16, float = float32)", choices=DTYPES)
    max_model_len: int | None = arg(None, "longest prompt + output in tokens; 32k = 32000, 32K = 32768 "
                                          "(default: the model's, capped at 2048 on CPU)", parse=human_readable_int)
    seed: int = arg(0, "engine seed for requests without their own")
    served_model_name: list[str] | None = arg(None, "model name(s) the server answers to (default: --model)",
                                              nargs="+")
    generation_config: str = arg("auto", "default sampling: auto (the model's generation_config.json), "
                                         "vllm (SamplingParams' defaults) or a directory holding one")
    override_generation_config: dict[str, Any] | None = arg(
        None, "JSON object on top of the generation config, e.g. '{\"temperature\": 0.5}'", parse=parse_json_object)
    max_logprobs: int = arg(20, "most logprobs (and prompt logprobs) a request may ask for")
    chat_template: str | None = arg(None, "chat template: a Jinja file or the template itself "
                                          "(default: the tokenizer's)")
    enforce_eager: bool = arg(False, "accepted for vLLM scripts; jaxlm runs compiled XLA programs only, "
                                     "so True is refused")
    # Filled by jaxlm.model_loader.resolve_model_config(): the transformers config.
    hf_config: Any = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.enforce_eager:
            raise ValueError("enforce_eager=True is not supported: jaxlm runs only compiled XLA programs "
                             "(--compilation-cache-dir keeps them across restarts)")
        if self.chat_template is not None and os.path.isfile(self.chat_template):
            with open(self.chat_template, encoding="utf-8") as f:
                self.chat_template = f.read()
        elif self.chat_template is not None and not any(c in self.chat_template for c in "{}\n"):
            raise ValueError(f"chat_template {self.chat_template!r} looks like a path, but no such file exists")


@dataclasses.dataclass
class LoadConfig:
    """How the checkpoint is read."""

    load_format: str = arg("auto", "checkpoint format (auto: from the path)", choices=LOAD_FORMATS)

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"Unknown load format {self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}"
            )


@dataclasses.dataclass
class CacheConfig:
    """The paged KV cache."""

    block_size: int = arg(16, "tokens per KV-cache block (a power of two)")
    gpu_memory_utilization: float = arg(0.9, "fraction of device memory for weights + KV cache")
    kv_cache_memory_bytes: int | None = arg(
        None, "bytes of KV cache, e.g. 4000000000, 1e9, 4GiB, 4G (overrides --gpu-memory-utilization)",
        parse=parse_bytes, flags=("--kv-cache-memory",))
    num_gpu_blocks_override: int | None = arg(None, "number of KV-cache blocks (overrides the memory sizing)")
    enable_prefix_caching: bool = arg(True, "reuse KV blocks of shared prompt prefixes")
    # Filled by the engine once the cache is sized.
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")


@dataclasses.dataclass
class SchedulerConfig:
    """Continuous batching: what one step may hold."""

    max_num_seqs: int = arg(64, "most requests running in one step")
    # 512 keeps a prefill step short enough not to stall the decodes beside it on CPU.
    max_num_batched_tokens: int = arg(512, "token budget of one step (chunked prefill splits longer prompts)",
                                      parse=human_readable_int)
    max_num_queued_reqs: int | None = arg(None, "most waiting requests before new ones are refused (HTTP 429)")
    async_scheduling: bool = arg(True, "schedule and prepare step N+1 while the device runs step N (decode "
                                       "inputs come from step N's tokens on the device); steps with "
                                       "structured outputs, penalties, min_tokens or bad words run synchronously, "
                                       "and it is off under pipeline parallel, several nodes or --token-buckets auto")
    # Not an argument: ModelConfig.max_model_len once resolved against the model (the engine
    # copies it here; the scheduler and the runner read it from here).
    max_model_len: int | None = None


@dataclasses.dataclass
class ParallelConfig:
    """How the model is spread over devices."""

    tensor_parallel_size: int = arg(1, "devices the weights are split over (mesh axis 'model')", flags=("-tp",))
    pipeline_parallel_size: int = arg(
        1, "pipeline stages: contiguous layer ranges, each on its own tensor-parallel sub-mesh (mesh axis "
           "'stage'); a step's requests run as micro-batches so the stages overlap", flags=("-pp",))
    # vLLM's meaning: engine-core processes, each with its own devices, KV cache and scheduler,
    # behind one front end (the server only; each core is itself a tp x pp mesh).
    data_parallel_size: int = arg(1, "engine-core processes (replicas of the model), each on its own devices",
                                  flags=("-dp",))
    # Several hosts (vLLM's multi-node flags): one process per node, one global mesh over all
    # their devices; the flags default to JAX's JAX_NUM_PROCESSES / JAX_PROCESS_ID /
    # JAX_COORDINATOR_ADDRESS when those are set (jaxlm.executor.distributed).
    nnodes: int = arg(1, "nodes (one process each) the model spans; the world size is over all of them")
    node_rank: int = arg(0, "this node's rank: 0 serves the API and schedules, the others run --headless")
    master_addr: str = arg("127.0.0.1", "address of the rank-0 node (JAX coordinator on --master-port, "
                                        "step broadcast on the next two ports)")
    master_port: int = arg(29501, "port of the JAX coordinator on the rank-0 node")
    headless: bool = arg(False, "serve no API: run this node's worker for the rank-0 node (node_rank > 0)")
    distributed_timeout_seconds: int = arg(
        30, "seconds a step or a silent peer node may take before the engine is declared dead")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes",
                     "distributed_timeout_seconds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._from_jax_environment()
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.headless and self.node_rank == 0:
            raise ValueError("--headless is for the nodes with --node-rank > 0 (rank 0 schedules and serves)")
        if not 0 < self.master_port < 65534:
            raise ValueError(
                f"master_port={self.master_port} must be in (0, 65534) (the next two ports are used too)")

    def _from_jax_environment(self) -> None:
        """JAX's usual variables (JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_COORDINATOR_ADDRESS=
        host:port) stand in for the flags when the flags leave one node."""
        num = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
        if self.nnodes > 1 or num <= 1:
            return
        address = os.environ.get("JAX_COORDINATOR_ADDRESS", "")
        if ":" not in address:
            raise ValueError(
                f"JAX_NUM_PROCESSES={num} needs JAX_COORDINATOR_ADDRESS=host:port, got {address!r}")
        self.master_addr, port = address.rsplit(":", 1)
        self.nnodes, self.master_port = num, int(port)
        self.node_rank = int(os.environ.get("JAX_PROCESS_ID", "0"))

    @property
    def world_size(self) -> int:
        """Devices of one engine core (data-parallel replicas each have their own)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclasses.dataclass
class CompilationConfig:
    """The AOT-compiled step programs and their on-disk cache."""

    token_buckets: list[int] | str | None = arg(
        None, "comma-separated padded token counts of a step (default: powers of two up to the budget); "
              "auto = derived, with --seq-buckets, from a simulation of the scheduler on --workload",
        parse=parse_token_buckets)
    seq_buckets: list[int] | None = arg(
        None, "comma-separated padded sequence counts sampled in a step (default: powers of two)",
        parse=parse_int_list)
    workload: str | None = arg(
        None, "the traffic --token-buckets auto is derived from: a JSONL of prompts (optional "
              "output_len), a ShareGPT JSON file, or synthetic[:num=N,prompt=A-B,output=C-D]")
    max_programs: int = arg(40, "most programs --token-buckets auto may compile")
    compilation_cache_dir: str | None = arg(
        None, "JAX persistent compilation cache ('' = off; default: <cache root>/xla, the cache root "
              "being $JAXLM_CACHE_DIR, else $XDG_CACHE_HOME/jaxlm, else ~/.cache/jaxlm)")

    def resolved_cache_dir(self) -> str | None:
        """The compilation cache directory, or None when off."""
        if self.compilation_cache_dir is not None:
            return self.compilation_cache_dir or None
        root = jaxlm_cache_root()
        return os.path.join(root, "xla") if root else None


@dataclasses.dataclass
class ObservabilityConfig:
    """Logging of stats and requests."""

    disable_log_stats: bool = arg(False, "no periodic throughput / cache usage log lines")
    enable_log_requests: bool = arg(False, "log each request's arrival and parameters")


@dataclasses.dataclass
class EngineConfig:
    """All configs of one engine (plus the attention backend)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    load_config: LoadConfig
    compilation_config: CompilationConfig
    attention_backend: str = arg("auto", "attention kernels (auto: pallas on GPU, xla elsewhere)",
                                 choices=ATTENTION_BACKENDS)
    observability_config: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)


# Every config that holds engine arguments, in --help order (one argument group each).
ARG_CONFIGS: tuple[type, ...] = (ModelConfig, LoadConfig, CacheConfig, SchedulerConfig, ParallelConfig,
                                 CompilationConfig, ObservabilityConfig, EngineConfig)


def arg_fields(config_cls: type) -> list[dataclasses.Field]:
    """The fields of ``config_cls`` that are engine arguments (those with help text)."""
    return [f for f in dataclasses.fields(config_cls) if f.metadata.get("help")]
