"""Bucket planning without a device: run the real scheduler on a workload, then pick bucket lists.

The shapes a step asks for come from the scheduler, not from request lengths: chunked prefill
fills the token budget, decode rows ride along with prompt chunks. The scheduler is pure Python,
so `simulate_steps` drives it with a stand-in runner that only counts, and `plan_buckets` picks
the token and sequence buckets that minimise the padding of those steps under a budget of
compiled programs (`auto`). `parse_bucket_spec` turns the named configurations (pow2, pow4,
linear:STEP, explicit lists) into the same two lists.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Protocol, Sequence

import numpy as np

from jaxlm.benchmarks.workload import load_workload
from jaxlm.config import CacheConfig, SchedulerConfig
from jaxlm.core.outputs import ModelRunnerOutput
from jaxlm.core.request import Request
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.core.scheduler import Scheduler
from jaxlm.sampling_params import SamplingParams
from jaxlm.worker.buckets import (
    PaddingStats, default_seq_buckets, pick_bucket, powers_of_two_up_to, prompt_logprobs_buckets)

logger = logging.getLogger(__name__)

# Programs the runner compiles (jaxlm/worker/model_runner.py warm_up, XLA attention): a body per
# token bucket, a prompt-logprobs body for every other one (buckets.prompt_logprobs_buckets), one
# sampler per serving variant per sequence bucket. A kernel backend adds decode-only bodies.
PROGRAMS_PER_SEQ_BUCKET = 6  # len(sample.metadata.SERVING_VARIANTS); kept jax-free here, a test checks it
# A padded sampler row computes one logits row (vocab x hidden); a padded body token the whole
# model without the logits. For a ~100M-parameter model with a 50k vocabulary the ratio is ~1/4.
DEFAULT_SAMPLE_ROW_COST = 0.25
# Most distinct step sizes the exact bucket search takes before rounding them onto a grid.
_MAX_DISTINCT = 2048


class PlannedRequest(Protocol):
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one step really needs: tokens, request rows, KV pages they read, sampled rows."""

    num_tokens: int
    num_reqs: int
    num_pages: int
    num_samples: int


@dataclasses.dataclass
class BucketPlan:
    token_buckets: list[int]
    seq_buckets: list[int]
    num_programs: int
    # Padding waste the plan gives on the simulated steps (PaddingStats.waste()).
    expected_waste: dict[str, float]

    def as_flags(self) -> str:
        """The flags that reproduce this plan on `python -m jaxlm.serve` / `LLM(...)` keywords."""
        return (f"--token-buckets {','.join(map(str, self.token_buckets))} "
                f"--seq-buckets {','.join(map(str, self.seq_buckets))}")


def count_programs(num_token_buckets: int, num_seq_buckets: int) -> int:
    num_prompt_logprobs = len(prompt_logprobs_buckets(list(range(num_token_buckets))))
    return num_token_buckets + num_prompt_logprobs + PROGRAMS_PER_SEQ_BUCKET * num_seq_buckets


class _CountingRunner:
    """Stands in for the model runner: samples a dummy token where the real one would sample."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.steps: list[StepShape] = []

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.scheduler.block_size
        req_ids, sampled, pages = [], [], 0
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            end = req.num_computed_tokens + n
            pages += -(-end // bs)
            req_ids.append(rid)
            sampled.append([100] if end >= req.num_tokens else [])
        if req_ids:
            self.steps.append(StepShape(so.total_num_scheduled_tokens, len(req_ids), pages,
                                        sum(1 for s in sampled if s)))
        return ModelRunnerOutput.from_lists(req_ids, sampled)


def _sim_cache_config(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> CacheConfig:
    if cache_config.num_gpu_blocks is not None:
        return cache_config
    # Not sized yet (no engine): enough blocks that max_num_seqs full-length requests never preempt.
    per_seq = -(-scheduler_config.max_model_len // cache_config.block_size)
    return dataclasses.replace(cache_config, num_gpu_blocks=per_seq * scheduler_config.max_num_seqs + 1)


def simulate_steps(
    requests: Sequence[PlannedRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    step_seconds: float | None = None,
) -> list[StepShape]:
    """Run the scheduler over the workload; one StepShape per step that computed tokens.

    Requests arrive at `arrival_time` mapped to steps of `step_seconds` each (None: all at once,
    the offline case). Outputs run to their `output_len` (eos ignored).
    """
    sched = Scheduler(scheduler_config, _sim_cache_config(scheduler_config, cache_config))
    runner = _CountingRunner(sched)
    arrivals: dict[int, list[Request]] = collections.defaultdict(list)
    for i, r in enumerate(requests):
        step = 0 if not step_seconds else int(r.arrival_time / step_seconds)
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        arrivals[step].append(Request(f"sim-{i}", list(r.prompt_token_ids), params))
    step = 0
    while sched.has_requests() or arrivals:
        for req in arrivals.pop(step, []):
            sched.add_request(req)
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
        step += 1
    return runner.steps


def padding_of(steps: Sequence[StepShape], token_buckets: list[int], seq_buckets: list[int],
               max_num_seqs: int, max_pages: int) -> PaddingStats:
    """The padding the runner would compute on these steps with these buckets (its accounting)."""
    stats = PaddingStats()
    for s in steps:
        T = pick_bucket(s.num_tokens, token_buckets)
        R = min(T, max_num_seqs)
        stats.record(s.num_tokens, T, s.num_reqs, R, s.num_pages, R * max_pages)
        if s.num_samples:
            stats.record_samples(s.num_samples, pick_bucket(s.num_samples, seq_buckets))
    return stats


def optimal_buckets(values: Sequence[int], cap: int, max_buckets: int) -> tuple[list[list[int]], list[float]]:
    """For k = 1..max_buckets: the k buckets (the largest = cap) minimising sum(bucket(v) - v).

    Exact dynamic programme over the distinct values (an optimal bucket always sits on a value
    it covers, or on cap). Returns (buckets per k, padding per k), index k - 1.
    """
    if max_buckets < 1:
        raise ValueError(f"need at least one bucket, got max_buckets={max_buckets}")
    counts = collections.Counter(int(v) for v in values)
    if counts and max(counts) > cap:
        raise ValueError(f"a step of {max(counts)} exceeds the largest bucket {cap}")
    if len(counts) > _MAX_DISTINCT:
        # The programme is O(n^2) in memory: round values up onto a grid (buckets stay >= values).
        g = -(-cap // _MAX_DISTINCT)
        counts = _regrid(counts, g, cap)
    u = np.array(sorted(v for v in counts if v < cap), np.float64)  # == cap: always in the cap bucket
    w = np.array([counts[int(v)] for v in u], np.float64)
    n = len(u)
    W = np.concatenate([[0.0], np.cumsum(w)])  # W[j] = weight of values[:j]
    S = np.concatenate([[0.0], np.cumsum(w * u)])
    tail_to_cap = lambda i: cap * (W[n] - W[i]) - (S[n] - S[i])  # noqa: E731  values[i:] -> cap
    # group[i, j]: values[i..j] padded to values[j] (inf where i > j).
    i_idx, j_idx = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    group = np.where(i_idx <= j_idx, u[j_idx] * (W[j_idx + 1] - W[i_idx]) - (S[j_idx + 1] - S[i_idx]), np.inf)
    best: list[list[int]] = [[cap]]
    cost: list[float] = [float(tail_to_cap(0))]
    # dp[j]: least padding of values[:j+1] with the last bucket on values[j]; back[k][j]: where its group starts.
    dp = group[0].copy() if n else np.zeros(0)
    back: list[np.ndarray] = [np.zeros(n, np.int64)]
    for k in range(2, max_buckets + 1):
        if k - 1 > n:
            best.append(best[-1])
            cost.append(cost[-1])
            continue
        tails = np.array([dp[j] + tail_to_cap(j + 1) for j in range(n)])
        j_last = int(np.argmin(tails))
        buckets, j, level = [cap], j_last, k - 2
        while True:
            buckets.append(int(u[j]))
            i = int(back[level][j])
            if level == 0:
                break
            j, level = i - 1, level - 1
        best.append(sorted(buckets))
        cost.append(float(tails[j_last]))
        # Extend for the next k: a new last bucket on values[j] over a group starting at i >= 1.
        prev = np.concatenate([[np.inf], dp[:-1]])  # prev[i] = dp[i - 1]
        total = prev[:, None] + group
        back.append(np.argmin(total, axis=0))
        dp = total[back[-1], np.arange(n)]
    return best, cost


def _regrid(counts: collections.Counter, g: int, cap: int) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for v, c in counts.items():
        out[min(-(-v // g) * g, cap)] += c
    return out


def plan_buckets(
    steps: Sequence[StepShape],
    scheduler_config: SchedulerConfig,
    max_programs: int,
    sample_row_cost: float = DEFAULT_SAMPLE_ROW_COST,
    block_size: int = 16,
) -> BucketPlan:
    """Token and sequence buckets minimising padded tokens + sample_row_cost x padded sampler
    rows over `steps`, with count_programs(...) <= max_programs."""
    min_programs = count_programs(1, 1)
    if max_programs < min_programs:
        raise ValueError(f"--max-programs must be at least {min_programs} (one token and one sequence "
                         f"bucket), got {max_programs}")
    budget, max_seqs = scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs
    most_t = max(k for k in range(1, max_programs + 1) if count_programs(k, 1) <= max_programs)
    most_s = max(k for k in range(1, max_programs + 1) if count_programs(1, k) <= max_programs)
    t_sets, t_cost = optimal_buckets([s.num_tokens for s in steps], budget, most_t)
    s_sets, s_cost = optimal_buckets([s.num_samples for s in steps if s.num_samples], max_seqs, most_s)
    choices = [(t_cost[kt - 1] + sample_row_cost * s_cost[ks - 1], kt, ks)
               for kt in range(1, most_t + 1) for ks in range(1, most_s + 1)
               if count_programs(kt, ks) <= max_programs]
    # Least cost; among equals the fewest programs.
    _, kt, ks = min(choices, key=lambda c: (c[0], count_programs(c[1], c[2])))
    tokens, seqs = _dedup(t_sets[kt - 1]), _dedup(s_sets[ks - 1])
    max_pages = -(-scheduler_config.max_model_len // block_size)
    waste = padding_of(steps, tokens, seqs, max_seqs, max_pages).waste()
    return BucketPlan(tokens, seqs, count_programs(len(tokens), len(seqs)), waste)


def _dedup(buckets: list[int]) -> list[int]:
    return sorted(set(buckets))


def derive_buckets(
    requests: Sequence[PlannedRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    max_programs: int,
    step_seconds: float | None = None,
    sample_row_cost: float = DEFAULT_SAMPLE_ROW_COST,
) -> BucketPlan:
    """`auto` buckets for a workload: simulate the scheduler on it, then plan_buckets."""
    steps = simulate_steps(requests, scheduler_config, cache_config, step_seconds)
    plan = plan_buckets(steps, scheduler_config, max_programs, sample_row_cost, cache_config.block_size)
    logger.info("auto buckets from %d simulated steps: %s (%d programs)", len(steps), plan.as_flags(),
                plan.num_programs)
    return plan


def _one_list(spec: str, cap: int, default: list[int]) -> list[int]:
    spec = spec.strip()
    if spec == "pow2":
        return powers_of_two_up_to(cap)
    if spec == "pow4":
        out = [1]
        while out[-1] < cap:
            out.append(out[-1] * 4)
        return out
    if spec.startswith("linear:"):
        step = spec.split(":", 1)[1]
        if not step.isdigit() or int(step) <= 0:
            raise ValueError(f"linear:STEP needs a positive integer step, got {spec!r}")
        step_n = int(step)
        return list(range(step_n, -(-cap // step_n) * step_n + 1, step_n))
    if spec == "default":
        return list(default)
    try:
        out = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"unknown bucket list {spec!r}: use pow2, pow4, linear:STEP or comma-separated "
                         f"sizes") from None
    if not out or out[0] <= 0:
        raise ValueError(f"bucket sizes must be positive integers, got {spec!r}")
    if out[-1] < cap:
        raise ValueError(f"the largest bucket of {spec!r} ({out[-1]}) is below {cap}")
    return out


def parse_bucket_spec(spec: str, max_num_batched_tokens: int, max_num_seqs: int) -> tuple[list[int], list[int]]:
    """A named configuration -> (token buckets, sequence buckets).

    `pow2`, `pow4`, `linear:STEP` or a comma list set the token buckets, the sequence buckets
    stay the engine's default (powers of 4); `tokens=A;seqs=B` sets both, each A/B any of those
    forms. `auto` needs a workload: use derive_buckets.
    """
    seq_default = default_seq_buckets(max_num_seqs)
    if spec.strip() == "auto":
        raise ValueError("'auto' buckets are derived from a workload: call derive_buckets")
    if "=" not in spec:
        return _one_list(spec, max_num_batched_tokens, []), seq_default
    parts = dict(p.split("=", 1) for p in spec.split(";") if p.strip())
    unknown = set(parts) - {"tokens", "seqs"}
    if unknown or "=" in "".join(parts.values()):
        raise ValueError(f"bad bucket config {spec!r}: expected tokens=...;seqs=...")
    tokens = _one_list(parts.get("tokens", "pow2"), max_num_batched_tokens, [])
    seqs = _one_list(parts.get("seqs", "default"), max_num_seqs, seq_default)
    return tokens, seqs


def resolve_auto_buckets(config: Any, tokenizer: Any) -> BucketPlan | None:
    """--token-buckets auto: derive both bucket lists from --workload, in place on the
    EngineConfig (before the runner compiles anything); None when buckets are not auto."""
    comp = config.compilation_config
    if comp.token_buckets != "auto":
        return None
    if not comp.workload:
        raise ValueError("--token-buckets auto needs --workload (a JSONL, ShareGPT file or synthetic:...)")
    vocab = int(config.model_config.hf_config.vocab_size)
    sched = config.scheduler_config
    workload = load_workload(comp.workload, vocab).tokenized(tokenizer).fitting(sched.max_model_len)
    plan = derive_buckets(workload.requests, sched, config.cache_config, comp.max_programs)
    comp.token_buckets, comp.seq_buckets = plan.token_buckets, plan.seq_buckets
    logger.info("--token-buckets auto from %s: %s (%d programs; expected padding %s)", comp.workload,
                plan.as_flags(), plan.num_programs, {k: round(v, 4) for k, v in plan.expected_waste.items()})
    return plan
