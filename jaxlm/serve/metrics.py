"""/metrics through prometheus_client, with vLLM's metric names and labels: every vllm: series
carries `model_name` and `engine` (the engine core that did the work, "0" .. data_parallel_size
- 1), so a dashboard sums over `engine` for the server's totals and splits by it to see whether
data parallelism is balanced. There is no separate total series (a sum would count it twice).

One CollectorRegistry per app (two servers in one process never share counters). Request-level
histograms and counters are recorded by the serving layer when a request's outputs arrive, under
the engine that served it; engine-level gauges, counters and the per-step histogram are read from
the engine's stats snapshot at scrape time by a collector; process metrics come from
prometheus_client's own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from jaxlm.outputs import RequestStateStats
from jaxlm.spec_decode.metrics import spec_decode_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds as in vLLM's V1 Prometheus stat logger.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]


def length_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


# (metric name, help, engine stats key)
_ENGINE_GAUGES = [
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_requests_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage_perc"),
]
_ENGINE_COUNTERS = [
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens_total"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens_total"),
    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions_total"),
    ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", "mm_cache_queries"),
    ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", "mm_cache_hits"),
]
FINISHED_REASONS = ("stop", "length", "abort")
LABELS = ["model_name", "engine"]
# Engine stats key -> where each engine core's value is: a SchedulerStats field (the core
# reports it) or an EngineTokenStats field (the front end counts it).
_SCHEDULER_FIELDS = {
    "num_requests_running": "num_running_reqs",
    "num_requests_waiting": "num_waiting_reqs",
    "kv_cache_usage_perc": "kv_cache_usage",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions_total": "num_preemptions",
    "mm_cache_queries": "mm_cache_queries",
    "mm_cache_hits": "mm_cache_hits",
}


def _lora_info(lora: dict[str, Any]) -> Metric:
    """vLLM's vllm:lora_requests_info: the adapters (comma-separated names) of running and waiting
    requests as labels, the time of the reading as the value."""
    labels = {"max_lora": str(lora["max_lora"]), "running_lora_adapters": ",".join(sorted(lora["running"])),
              "waiting_lora_adapters": ",".join(sorted(lora["waiting"]))}
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.", labels=list(labels))
    family.add_metric(list(labels.values()), time.time())
    return family


class EngineStatsCollector:
    """Engine-level metrics from the stats snapshot, read at scrape time (the engine counts;
    the server only exposes): gauges, counters, vllm:iteration_tokens_total and
    vllm:cache_config_info, one series per engine core. An engine that reports no per-core
    stats (one core) has its totals as engine "0"."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict[str, Any]],
                 cache_config_info: dict[str, str], model_config: Any = None) -> None:
        self.model_name = model_name
        self.get_stats = get_stats
        self.cache_config_info = cache_config_info
        self.model_config = model_config  # its weight_bytes and quantization, once loaded

    def collect(self) -> Iterable[Metric]:
        stats = self.get_stats()
        engines = stats.get("engines") or [None]
        tokens = stats.get("engine_tokens") or [None] * len(engines)
        for family_cls, specs in ((GaugeMetricFamily, _ENGINE_GAUGES), (CounterMetricFamily, _ENGINE_COUNTERS)):
            for name, help_text, key in specs:
                family = family_cls(name, help_text, labels=LABELS)
                for index, (sched, tok) in enumerate(zip(engines, tokens)):
                    family.add_metric([self.model_name, str(index)], _engine_value(stats, key, sched, tok))
                yield family
        steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                      labels=LABELS)
        for index, tok in enumerate(tokens):
            _add_iteration_tokens(steps, [self.model_name, str(index)],
                                  tok.iteration_tokens if tok is not None else stats.get("iteration_tokens"))
        yield steps
        yield from spec_decode_families(stats, self.model_name)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*self.cache_config_info, "engine"])
        for index in range(len(engines)):
            info.add_metric([*self.cache_config_info.values(), str(index)], 1.0)
        yield info
        if stats.get("lora") is not None:
            yield _lora_info(stats["lora"])
        if self.model_config is not None and self.model_config.weight_bytes:
            weights = GaugeMetricFamily("vllm:model_weight_bytes",
                                        "Bytes the model's weights take on the devices (quantized in their own bytes).",
                                        labels=["model_name", "quantization", "engine"])
            for index in range(len(engines)):  # every engine core holds its own copy
                weights.add_metric([self.model_name, self.model_config.quantization or "none", str(index)],
                                   float(self.model_config.weight_bytes))
            yield weights


def _engine_value(stats: dict[str, Any], key: str, sched: Any, tokens: Any) -> float:
    """One engine core's value of an engine stats key (the total when there is no per-core stat)."""
    if sched is not None and key in _SCHEDULER_FIELDS:
        return float(getattr(sched, _SCHEDULER_FIELDS[key]))
    if tokens is not None and hasattr(tokens, key):
        return float(getattr(tokens, key))
    return float(stats.get(key, 0) or 0)


def _add_iteration_tokens(family: HistogramMetricFamily, values: list[str], snapshot: Any) -> None:
    from jaxlm.engine.engine_stats import ITERATION_TOKENS_BUCKETS

    counts = snapshot.bucket_counts if snapshot is not None else [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    cumulative, buckets = 0, []
    for bound, n in zip([*map(str, map(float, ITERATION_TOKENS_BUCKETS)), "+Inf"], counts):
        cumulative += n
        buckets.append((bound, float(cumulative)))
    family.add_metric(values, buckets, float(snapshot.sum if snapshot is not None else 0))


# Request-level histograms: (attribute, metric name, help, bucket bounds: a list or "lengths").
_REQUEST_HISTOGRAMS = [
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    # vLLM's older name of the same per-token interval; Grafana dashboards still read it.
    ("tpot", "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS),
    ("request_tpot", "vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     REQUEST_LATENCY_BUCKETS),
    ("queue_time", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("prefill_time", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("decode_time", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("inference_time", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
    ("prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed.", "lengths"),
    ("generation_tokens", "vllm:request_generation_tokens", "Number of generation tokens processed.", "lengths"),
    ("max_generation_tokens", "vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", "lengths"),
    ("params_n", "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
    ("params_max_tokens", "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     "lengths"),
]


class _EngineSeries:
    """One engine core's request-level series (the children labelled with its index)."""

    def __init__(self, families: dict[str, Any], success: Any, model_name: str, engine: int) -> None:
        labels = (model_name, str(engine))
        for attr, family in families.items():
            setattr(self, attr, family.labels(*labels))
        self.success = {reason: success.labels(*labels, reason) for reason in FINISHED_REASONS}


class ServerMetrics:
    """The app's registry and the request-level metrics the serving layer records, per engine
    core (`engine` = the index of the core that served the request)."""

    def __init__(self, model_name: str, max_model_len: int = 2048,
                 get_stats: Callable[[], dict[str, Any]] | None = None,
                 cache_config_info: dict[str, str] | None = None, num_engines: int = 1,
                 model_config: Any = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(EngineStatsCollector(model_name, get_stats or dict, cache_config_info or {},
                                                    model_config))
        lengths = length_buckets(max_model_len)
        self._families = {
            attr: Histogram(name, help_text, LABELS, registry=self.registry,
                            buckets=lengths if buckets == "lengths" else buckets)
            for attr, name, help_text, buckets in _REQUEST_HISTOGRAMS}
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*LABELS, "finished_reason"], registry=self.registry)
        # Every core's series exist from the start (at 0), as vLLM's.
        self._engines = {i: self._new_series(i) for i in range(max(1, num_engines))}

    def _new_series(self, engine: int) -> _EngineSeries:
        return _EngineSeries(self._families, self._success, self.model_name, engine)

    def engine(self, index: int) -> _EngineSeries:
        series = self._engines.get(index)
        if series is None:
            series = self._engines[index] = self._new_series(index)
        return series

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---------------------------------------------------------------- recording
    def observe_first_token(self, seconds: float, engine: int = 0) -> None:
        self.engine(engine).ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, engine: int = 0) -> None:
        series = self.engine(engine)
        series.itl.observe(seconds)
        series.tpot.observe(seconds)

    def observe_sequence_finished(self, finish_reason: str | None, prompt_len: int, n: int, max_tokens: int | None,
                                  stats: RequestStateStats | None, num_generation_tokens: int,
                                  e2e_seconds: float, engine: int = 0) -> None:
        """One finished sequence (each of a request's n is one, as in vLLM). stats: the engine's
        timestamps (None from an engine that keeps none: only the frontend's figures then)."""
        m = self.engine(engine)
        m.success[finish_reason if finish_reason in m.success else "abort"].inc()
        m.e2e.observe(e2e_seconds)
        m.prompt_tokens.observe(prompt_len)
        m.generation_tokens.observe(num_generation_tokens)
        m.params_n.observe(n)
        if max_tokens is not None:
            m.params_max_tokens.observe(max_tokens)
        if stats is None or stats.scheduled_ts is None:
            return  # never scheduled (aborted while waiting): no phase times
        now = time.time()
        first = stats.first_token_ts or now
        last = stats.last_token_ts or now
        m.queue_time.observe(max(0.0, stats.scheduled_ts - (stats.queued_ts or stats.arrival_time)))
        m.prefill_time.observe(max(0.0, first - stats.scheduled_ts))
        m.decode_time.observe(max(0.0, last - first))
        m.inference_time.observe(max(0.0, last - stats.scheduled_ts))
        if num_generation_tokens > 1:
            m.request_tpot.observe(max(0.0, last - first) / (num_generation_tokens - 1))

    def observe_request_finished(self, max_num_generation_tokens: int, engine: int = 0) -> None:
        """Once per request: the most tokens any of its n sequences generated."""
        self.engine(engine).max_generation_tokens.observe(max_num_generation_tokens)


def cache_config_info(cache_config: Any) -> dict[str, str]:
    """vllm:cache_config_info's labels: the CacheConfig's scalar fields, as strings."""
    fields = dataclasses.asdict(cache_config) if dataclasses.is_dataclass(cache_config) else {}
    # vLLM's label for the KV cache's dtype is CacheConfig.cache_dtype (its --kv-cache-dtype).
    return {("cache_dtype" if k == "kv_cache_dtype" else k): str(v) for k, v in fields.items()
            if isinstance(v, (str, int, float, bool)) or v is None}


def parse_metrics(text: str) -> dict[str, float]:
    """Sample -> value ('name{labels}' keys, labels sorted), through prometheus_client's parser;
    for tests and the bench script."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
