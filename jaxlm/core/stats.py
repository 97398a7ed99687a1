"""Scheduler statistics, read by the engine's logger and the /metrics endpoint."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (vLLM's queries/hits)."""

    # Requests looked up (first admission only; resumes after preemption are not counted).
    requests: int = 0
    # Tokens looked up (the prompt length of each counted request).
    queries: int = 0
    # Tokens found in the cache.
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclasses.dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Fraction of KV blocks held by requests, in [0, 1].
    kv_cache_usage: float = 0.0
    # Cumulative, in tokens.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Cumulative number of preemptions.
    num_preemptions: int = 0
    # LoRA adapter name -> requests running / waiting with it (vllm:lora_requests_info).
    running_lora_adapters: dict[str, int] = dataclasses.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def merge_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The totals over data-parallel engine cores (KV usage: the mean over the cores; each
    core has a cache of the same size)."""
    if not stats:
        return SchedulerStats()
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        running_lora_adapters=_sum_counts(s.running_lora_adapters for s in stats),
        waiting_lora_adapters=_sum_counts(s.waiting_lora_adapters for s in stats),
    )


def _sum_counts(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
