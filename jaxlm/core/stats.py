"""Scheduler statistics, read by the engine's logger and the /metrics endpoint."""

from __future__ import annotations

import dataclasses

import numpy as np


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
class SpecDecodingStats:
    """Cumulative speculative-decoding counters (vLLM's names): a draft is one request's drafted
    tokens verified in one step; accepted per position counts drafts whose i-th token was accepted."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def observe_drafts(self, num_draft_tokens: np.ndarray, num_accepted_tokens: np.ndarray) -> None:
        """Many drafts at once (one per speculating request of a step)."""
        self.num_drafts += len(num_draft_tokens)
        self.num_draft_tokens += int(num_draft_tokens.sum())
        self.num_accepted_tokens += int(num_accepted_tokens.sum())
        k = len(self.num_accepted_tokens_per_pos)
        # Drafts with more than j accepted tokens, for each position j.
        more = np.cumsum(np.bincount(np.minimum(num_accepted_tokens, k), minlength=k + 1)[::-1])[::-1]
        for j in range(k):
            self.num_accepted_tokens_per_pos[j] += int(more[j + 1])

    def copy(self) -> "SpecDecodingStats":
        return dataclasses.replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))


def merge_spec_decoding_stats(stats: list[SpecDecodingStats | None]) -> SpecDecodingStats | None:
    """Sums over engine cores (None when no core speculates)."""
    stats = [s for s in stats if s is not None]
    if not stats:
        return None
    k = max(s.num_spec_tokens for s in stats)
    total = SpecDecodingStats.new(k)
    for s in stats:
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        for i, n in enumerate(s.num_accepted_tokens_per_pos):
            total.num_accepted_tokens_per_pos[i] += n
    return total


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
    # Cumulative, in images (vLLM's mm_cache_queries / mm_cache_hits): the images of admitted
    # requests, and those the prefix cache covered so that they were never encoded.
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    # Cumulative; None unless the engine speculates.
    spec_decoding_stats: SpecDecodingStats | None = None
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
        mm_cache_queries=sum(s.mm_cache_queries for s in stats),
        mm_cache_hits=sum(s.mm_cache_hits for s in stats),
        spec_decoding_stats=merge_spec_decoding_stats([s.spec_decoding_stats for s in stats]),
        running_lora_adapters=_sum_counts(s.running_lora_adapters for s in stats),
        waiting_lora_adapters=_sum_counts(s.waiting_lora_adapters for s in stats),
    )


def _sum_counts(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
