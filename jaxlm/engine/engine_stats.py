"""What the front end counts per engine core, for /metrics (vLLM's `engine` label) and the stats
log line: the prompt and generation tokens of each core's steps and its tokens-per-step
histogram, beside the SchedulerStats each core reports.

Kept on the engine thread; get_stats hands out copies (the server reads them on another)."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from jaxlm.core.stats import SchedulerStats, merge_scheduler_stats

# vllm:iteration_tokens_total bucket bounds (vLLM's).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclasses.dataclass
class IterationTokensStats:
    """Cumulative histogram of the tokens each engine step handled: the prompt tokens of requests
    whose first token came out in it plus its new tokens (vLLM's IterationStats rule)."""

    bucket_counts: list[int] = dataclasses.field(
        default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))  # last: +Inf
    sum: int = 0
    count: int = 0

    def observe(self, num_tokens: int) -> None:
        self.bucket_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens
        self.count += 1

    def snapshot(self) -> "IterationTokensStats":
        return IterationTokensStats(list(self.bucket_counts), self.sum, self.count)


@dataclasses.dataclass
class EngineTokenStats:
    """One engine core's steps as the front end saw them."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    iteration_tokens: IterationTokensStats = dataclasses.field(default_factory=IterationTokensStats)

    def snapshot(self) -> "EngineTokenStats":
        return EngineTokenStats(self.prompt_tokens_total, self.generation_tokens_total,
                                self.iteration_tokens.snapshot())


class FrontendStats:
    """Token counters per engine core (index = the core's engine_index)."""

    def __init__(self, num_engines: int) -> None:
        self.engines = [EngineTokenStats() for _ in range(num_engines)]

    def record_step(self, engine_index: int, prompt_tokens: int, generation_tokens: int) -> None:
        """One step's outputs of one core: the prompts whose first token came out, the new tokens."""
        stats = self.engines[engine_index]
        stats.prompt_tokens_total += prompt_tokens
        stats.generation_tokens_total += generation_tokens
        stats.iteration_tokens.observe(prompt_tokens + generation_tokens)

    def get_stats(self, scheduler_stats: list[SchedulerStats]) -> dict[str, Any]:
        """The totals over the cores (vLLM's metric names as keys), and per core its
        SchedulerStats ("engines") and token counters ("engine_tokens")."""
        s = merge_scheduler_stats(scheduler_stats)
        tokens = [e.snapshot() for e in self.engines]
        return {
            "num_requests_running": s.num_running_reqs,
            "num_requests_waiting": s.num_waiting_reqs,
            "kv_cache_usage_perc": s.kv_cache_usage,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions_total": s.num_preemptions,
            "mm_cache_queries": s.mm_cache_queries,
            "mm_cache_hits": s.mm_cache_hits,
            "prompt_tokens_total": sum(t.prompt_tokens_total for t in tokens),
            "generation_tokens_total": sum(t.generation_tokens_total for t in tokens),
            "spec_decoding": s.spec_decoding_stats,  # None unless the engine speculates
            "engines": list(scheduler_stats),
            "engine_tokens": tokens,
        }
