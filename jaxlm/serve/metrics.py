"""/metrics in Prometheus text format, with vLLM's metric names and a `model_name` label.

Written by hand (no prometheus_client dependency): a few gauges and counters read from the
engine's stats snapshot, plus request-level counters and histograms recorded by the frontend.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Any

# Bucket bounds as in vLLM's V1 stat logger.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# (metric name, type, help, engine stats key)
_ENGINE_METRICS = [
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "num_requests_running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage_perc"),
    ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", "prompt_tokens_total"),
    ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", "generation_tokens_total"),
    ("vllm:num_preemptions", "counter", "Cumulative number of preemptions from the engine.", "num_preemptions_total"),
]
FINISHED_REASONS = ("stop", "length", "abort")


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return f"{float(value):.1f}"
    return repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


class Histogram:
    def __init__(self, buckets: list[float]) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, labels: dict[str, str]) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip(self.bounds + [math.inf], self.counts):
            cumulative += n
            lines.append(f"{name}_bucket{_labels({**labels, 'le': _fmt(bound)})} {_fmt(cumulative)}")
        lines.append(f"{name}_count{_labels(labels)} {_fmt(self.count)}")
        lines.append(f"{name}_sum{_labels(labels)} {_fmt(self.sum)}")
        return lines


class ServerMetrics:
    """Request-level metrics recorded by the serving layer (thread-safe: render may race)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.success = dict.fromkeys(FINISHED_REASONS, 0)

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def observe_finished(self, finish_reason: str | None, e2e_seconds: float) -> None:
        reason = finish_reason if finish_reason in self.success else "abort"
        with self._lock:
            self.success[reason] += 1
            self.e2e.observe(e2e_seconds)

    def render(self, engine_stats: dict[str, Any]) -> str:
        base = {"model_name": self.model_name}
        out: list[str] = []
        for name, kind, help_text, key in _ENGINE_METRICS:
            value = float(engine_stats.get(key, 0) or 0)
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            sample = name + "_total" if kind == "counter" else name
            out.append(f"{sample}{_labels(base)} {_fmt(value)}")
        with self._lock:
            out.append("# HELP vllm:request_success Count of successfully processed requests.")
            out.append("# TYPE vllm:request_success counter")
            for reason, n in self.success.items():
                out.append(f"vllm:request_success_total{_labels({**base, 'finished_reason': reason})} {_fmt(n)}")
            for name, help_text, hist in (
                ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
                ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
                ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e),
            ):
                out.append(f"# HELP {name} {help_text}")
                out.append(f"# TYPE {name} histogram")
                out.extend(hist.render(name, base))
        return "\n".join(out) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample line -> value ('name{labels}' keys); for tests and the bench script."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
    return values
