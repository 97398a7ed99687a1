"""Speculative decoding's metrics (vLLM's names): the Prometheus families /metrics and
LLM.get_metrics() read, and the periodic "SpecDecoding metrics" log line.

The counters are cumulative SpecDecodingStats in each engine core's SchedulerStats; the log line
shows the interval since the previous one. Light: prometheus_client only, no jax.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Callable

from jaxlm.core.stats import SpecDecodingStats

# (metric name, help, SpecDecodingStats field)
_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
)


def spec_decode_families(stats: dict[str, Any], model_name: str) -> Iterable[Any]:
    """The spec-decode counters from an engine stats snapshot (LLMEngine.get_stats), when the
    engine speculates: one series per engine core (labels model_name and engine, as every
    vllm: series; a snapshot without per-core stats is engine "0")."""
    from prometheus_client.core import CounterMetricFamily

    total: SpecDecodingStats | None = stats.get("spec_decoding")
    if total is None:
        return
    cores = [e.spec_decoding_stats for e in stats.get("engines") or ()] or [total]
    per_core = [(str(i), s) for i, s in enumerate(cores) if s is not None]
    for name, help_text, field in _COUNTERS:
        family = CounterMetricFamily(name, help_text, labels=["model_name", "engine"])
        for engine, s in per_core:
            family.add_metric([model_name, engine], float(getattr(s, field)))
        yield family
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted tokens per draft position.", labels=["model_name", "engine", "position"])
    for engine, s in per_core:
        for pos, n in enumerate(s.num_accepted_tokens_per_pos):
            family.add_metric([model_name, engine, str(pos)], float(n))
    yield family


class SpecDecodingLogging:
    """vLLM's "SpecDecoding metrics" line over the interval since the last one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: SpecDecodingStats | None = None
        self._last_time = clock()

    def log(self, stats: SpecDecodingStats | None, log_fn: Callable[..., None]) -> None:
        if stats is None:
            return
        now, last = self._clock(), self._last
        prev = last if last is not None else SpecDecodingStats.new(len(stats.num_accepted_tokens_per_pos))
        drafts = stats.num_drafts - prev.num_drafts
        drafted = stats.num_draft_tokens - prev.num_draft_tokens
        accepted = stats.num_accepted_tokens - prev.num_accepted_tokens
        elapsed = now - self._last_time
        self._last, self._last_time = stats.copy(), now
        if drafts <= 0:
            return
        per_pos = [(a - b) / drafts for a, b in zip(stats.num_accepted_tokens_per_pos, prev.num_accepted_tokens_per_pos)]
        log_fn("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
               "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
               "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
               1 + accepted / drafts, accepted / elapsed if elapsed > 0 else 0.0,
               drafted / elapsed if elapsed > 0 else 0.0, accepted, drafted,
               ", ".join(f"{p:.3f}" for p in per_pos), 100 * accepted / drafted if drafted else float("nan"))
