"""The periodic stats line (vLLM's LoggingStatLogger): "Avg prompt throughput: ..." every
interval while the engine works (at debug level while it idles). Off with --disable-log-stats
(ObservabilityConfig), and for LLM by default, as in vLLM."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from jaxlm.spec_decode.metrics import SpecDecodingLogging

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0


def log_stats_interval() -> float:
    """Seconds between two lines: $JAXLM_LOG_STATS_INTERVAL, else vLLM's $VLLM_LOG_STATS_INTERVAL."""
    value = os.environ.get("JAXLM_LOG_STATS_INTERVAL") or os.environ.get("VLLM_LOG_STATS_INTERVAL")
    try:
        interval = float(value) if value else DEFAULT_INTERVAL_S
    except ValueError:
        raise ValueError(f"JAXLM_LOG_STATS_INTERVAL={value!r} is not a number of seconds") from None
    return interval if interval > 0 else DEFAULT_INTERVAL_S


class LoggingStatLogger:
    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = log_stats_interval() if interval_s is None else interval_s
        self._last = time.monotonic()
        self._last_tokens = (0, 0)
        self._spec = SpecDecodingLogging()  # its "SpecDecoding metrics" line, when the engine speculates

    def maybe_log(self, get_stats: Callable[[], dict[str, Any]]) -> None:
        """Logs when the interval has passed; get_stats is called only then."""
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed < self.interval_s:
            return
        s = get_stats()
        prompt, generation = s["prompt_tokens_total"], s["generation_tokens_total"]
        p0, g0 = self._last_tokens
        idle = (prompt, generation) == (p0, g0) and not s["num_requests_running"] and not s["num_requests_waiting"]
        hit_rate = s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0
        (logger.debug if idle else logger.info)(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            (prompt - p0) / elapsed, (generation - g0) / elapsed, s["num_requests_running"],
            s["num_requests_waiting"], 100 * s["kv_cache_usage_perc"], 100 * hit_rate)
        self._spec.log(s.get("spec_decoding"), logger.debug if idle else logger.info)
        self._last = now
        self._last_tokens = (prompt, generation)
