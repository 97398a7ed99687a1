"""/metrics through prometheus_client, with vLLM's metric names and a `model_name` label.

One CollectorRegistry per app (two servers in one process never share counters). Request-level
histograms and counters are recorded by the serving layer when a request's outputs arrive;
engine-level gauges, counters and the per-step histogram are read from the engine's stats
snapshot at scrape time by a collector; process metrics come from prometheus_client's own.
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
]
FINISHED_REASONS = ("stop", "length", "abort")
# Engine stats key -> the SchedulerStats field each engine core reports it in.
_PER_ENGINE_FIELDS = {
    "num_requests_running": "num_running_reqs",
    "num_requests_waiting": "num_waiting_reqs",
    "kv_cache_usage_perc": "kv_cache_usage",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions_total": "num_preemptions",
}


class EngineStatsCollector:
    """Engine-level metrics from the stats snapshot, read at scrape time (the engine counts;
    the server only exposes): gauges, counters, vllm:iteration_tokens_total and
    vllm:cache_config_info. The scheduler's series come as the total (model_name only) and one
    per engine core (vLLM's `engine` label, "0" .. data_parallel_size - 1)."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict[str, Any]],
                 cache_config_info: dict[str, str]) -> None:
        self.labels = {"model_name": model_name}
        self.get_stats = get_stats
        self.cache_config_info = cache_config_info

    def collect(self) -> Iterable[Metric]:
        stats = self.get_stats()
        names, values = list(self.labels), list(self.labels.values())
        engines = stats.get("engines") or []
        for family_cls, specs in ((GaugeMetricFamily, _ENGINE_GAUGES), (CounterMetricFamily, _ENGINE_COUNTERS)):
            for name, help_text, key in specs:
                family = family_cls(name, help_text, labels=names)
                family.add_metric(values, float(stats.get(key, 0) or 0))
                field = _PER_ENGINE_FIELDS.get(key)
                for index, engine in enumerate(engines if field else ()):
                    sample = family.samples[-1]  # the total's sample name (counters add "_total")
                    family.samples.append(sample._replace(
                        labels={**self.labels, "engine": str(index)}, value=float(getattr(engine, field))))
                yield family
        yield self._iteration_tokens(stats.get("iteration_tokens"), names, values)
        yield from spec_decode_families(stats, self.labels)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self.cache_config_info))
        info.add_metric(list(self.cache_config_info.values()), 1.0)
        yield info

    @staticmethod
    def _iteration_tokens(snapshot: Any, names: list[str], values: list[str]) -> Metric:
        from jaxlm.engine.output_processor import ITERATION_TOKENS_BUCKETS

        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                       labels=names)
        counts = snapshot.bucket_counts if snapshot is not None else [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, map(float, ITERATION_TOKENS_BUCKETS)), "+Inf"], counts):
            cumulative += n
            buckets.append((bound, float(cumulative)))
        family.add_metric(values, buckets, float(snapshot.sum if snapshot is not None else 0))
        return family


class ServerMetrics:
    """The app's registry and the request-level metrics the serving layer records."""

    def __init__(self, model_name: str, max_model_len: int = 2048,
                 get_stats: Callable[[], dict[str, Any]] | None = None,
                 cache_config_info: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(EngineStatsCollector(model_name, get_stats or dict, cache_config_info or {}))
        labels = ["model_name"]

        def histogram(name: str, help_text: str, buckets: list[float]) -> Any:
            return Histogram(name, help_text, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        # vLLM's older name of the same per-token interval; Grafana dashboards still read it.
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        lengths = length_buckets(max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lengths)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", lengths)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.",
                                               lengths)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", lengths)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---------------------------------------------------------------- recording
    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def observe_sequence_finished(self, finish_reason: str | None, prompt_len: int, n: int, max_tokens: int | None,
                                  stats: RequestStateStats | None, num_generation_tokens: int,
                                  e2e_seconds: float) -> None:
        """One finished sequence (each of a request's n is one, as in vLLM). stats: the engine's
        timestamps (None from an engine that keeps none: only the frontend's figures then)."""
        self.success[finish_reason if finish_reason in self.success else "abort"].inc()
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.observe(prompt_len)
        self.generation_tokens.observe(num_generation_tokens)
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        if stats is None or stats.scheduled_ts is None:
            return  # never scheduled (aborted while waiting): no phase times
        now = time.time()
        first = stats.first_token_ts or now
        last = stats.last_token_ts or now
        self.queue_time.observe(max(0.0, stats.scheduled_ts - (stats.queued_ts or stats.arrival_time)))
        self.prefill_time.observe(max(0.0, first - stats.scheduled_ts))
        self.decode_time.observe(max(0.0, last - first))
        self.inference_time.observe(max(0.0, last - stats.scheduled_ts))
        if num_generation_tokens > 1:
            self.request_tpot.observe(max(0.0, last - first) / (num_generation_tokens - 1))

    def observe_request_finished(self, max_num_generation_tokens: int) -> None:
        """Once per request: the most tokens any of its n sequences generated."""
        self.max_generation_tokens.observe(max_num_generation_tokens)


def cache_config_info(cache_config: Any) -> dict[str, str]:
    """vllm:cache_config_info's labels: the CacheConfig's scalar fields, as strings."""
    fields = dataclasses.asdict(cache_config) if dataclasses.is_dataclass(cache_config) else {}
    return {k: str(v) for k, v in fields.items() if isinstance(v, (str, int, float, bool)) or v is None}


def parse_metrics(text: str) -> dict[str, float]:
    """Sample -> value ('name{labels}' keys, labels sorted), through prometheus_client's parser;
    for tests and the bench script."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
