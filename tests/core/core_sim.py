"""A fake model runner and a driver loop for the core tests (no jax).

The fake runner keeps a fake KV cache (slot -> (token id, position)) and checks, every step,
that each scheduled request's context is really in the blocks of its block table: a block
shared or reused wrongly, a bad prefix hit or a lost block shows up as a wrong slot.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable

import numpy as np

from jaxlm.config import CacheConfig, SchedulerConfig
from jaxlm.core.outputs import EngineCoreOutput, LogprobsLists, ModelRunnerOutput
from jaxlm.core.request import Request
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.core.scheduler import Scheduler
from jaxlm.sampling_params import SamplingParams

TokenFn = Callable[[str, int], int]


def default_token_fn(req_id: str, position: int) -> int:
    """Deterministic 'sample' of a request at a position; never 0..99 (reserved for eos etc.)."""
    return 100 + zlib.crc32(f"{req_id}:{position}".encode()) % 5000


@dataclasses.dataclass
class _RunnerReq:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


class FakeRunner:
    def __init__(self, block_size: int, token_fn: TokenFn = default_token_fn, logprobs: bool = False):
        self.block_size = block_size
        self.token_fn = token_fn
        self.logprobs = logprobs
        self.kv: dict[int, tuple[int, int]] = {}
        self.reqs: dict[str, _RunnerReq] = {}
        # req_id -> output_token_ids the runner had before the request was preempted.
        self.preempted_outputs: dict[str, list[int]] = {}

    def _slot(self, st: _RunnerReq, pos: int) -> int:
        return st.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        return self.run_step(so)

    def update_states(self, so: SchedulerOutput) -> None:
        """The scheduler's view: preempted, finished, new and cached requests."""
        for rid in so.preempted_req_ids:
            st = self.reqs.pop(rid)
            self.preempted_outputs[rid] = st.tokens  # check the resume against it
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            if new.req_id in self.preempted_outputs:
                before = self.preempted_outputs.pop(new.req_id)
                assert tokens == before, "a resumed request must carry its generated tokens"
            assert new.num_computed_tokens % self.block_size == 0
            self.reqs[new.req_id] = _RunnerReq(tokens, list(new.block_ids), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            st = self.reqs[rid]
            assert st.num_computed == num_computed, (rid, st.num_computed, num_computed)
            st.block_ids.extend(new_blocks)

    def run_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # Read every context first (state before the step), then write: like one batched forward.
        writes: dict[int, tuple[int, int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            start = st.num_computed
            assert n > 0 and start + n <= len(st.tokens), (rid, start, n, len(st.tokens))
            assert len(st.block_ids) * self.block_size >= start + n, "not enough blocks"
            for pos in range(start):
                got = self.kv.get(self._slot(st, pos))
                assert got == (st.tokens[pos], pos), f"{rid}: bad K/V at position {pos}: {got}"
            for pos in range(start, start + n):
                slot = self._slot(st, pos)
                assert slot not in writes, f"two writes to slot {slot} in one step"
                writes[slot] = (st.tokens[pos], pos)
        self.kv.update(writes)

        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            st.num_computed += n
            req_ids.append(rid)
            if st.num_computed == len(st.tokens):
                tok = self.token_fn(rid, len(st.tokens))
                st.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        lp = None
        if self.logprobs:  # one row per sampled token: [token, token + 1] with logprob -i (its request's row)
            first = np.array([s[0] for s in sampled if s], np.int64)
            rows = np.array([i for i, s in enumerate(sampled) if s], np.float32)
            lp = LogprobsLists(
                token_ids=np.stack([first, first + 1], axis=1),
                logprobs=-rows[:, None].repeat(2, 1),
                ranks=np.ones(len(first), np.int64),
            )
        return ModelRunnerOutput.from_lists(req_ids, sampled, logprobs=lp)


def check_block_invariants(sched: Scheduler) -> None:
    """O(blocks) consistency check of the pool against the block tables (tests only)."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders = {b.block_id: 0 for b in pool.blocks}
    for blocks in kv.req_to_blocks.values():
        assert len({id(b) for b in blocks}) == len(blocks), "a block twice in one table"
        for b in blocks:
            holders[b.block_id] += 1
    for b in pool.blocks:
        assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])
        assert (b.ref_cnt == 0) == (b.block_id in pool.free_block_queue), b
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h
    assert set(kv.req_to_blocks) <= {r.request_id for r in sched.running}


@dataclasses.dataclass
class RunResult:
    outputs: dict[str, list[int]]
    finish: dict[str, EngineCoreOutput]
    steps: list[SchedulerOutput]


def run_engine(
    sched: Scheduler,
    runner: FakeRunner,
    arrivals: dict[int, list[Request]] | None = None,
    max_steps: int = 5000,
    check_blocks: bool = True,
) -> RunResult:
    """schedule -> runner -> update until nothing is left; checks per-step limits.

    ``arrivals`` maps a step index to requests added just before that step.
    """
    cfg = sched.scheduler_config
    arrivals = dict(arrivals or {})
    outputs: dict[str, list[int]] = {}
    finish: dict[str, EngineCoreOutput] = {}
    steps: list[SchedulerOutput] = []
    step = 0
    while sched.has_requests() or arrivals:
        for req in arrivals.pop(step, []):
            sched.add_request(req)
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        steps.append(so)
        mro = runner.execute_model(so)
        for out in sched.update_from_output(so, mro):
            assert out.req_id not in finish, f"{out.req_id} produced output after finishing"
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.req_id] = out
        if check_blocks:
            check_block_invariants(sched)
        step += 1
        assert step < max_steps, "the scheduler does not make progress"
    return RunResult(outputs, finish, steps)


def make_scheduler(
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    cache.num_gpu_blocks = num_blocks
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        scheduling_policy=scheduling_policy,
    )
    return Scheduler(sched_cfg, cache)


def make_request(
    req_id: str, prompt: list[int], eos_token_id: int | None = None, **params
) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(req_id, list(prompt), SamplingParams(**params), eos_token_id=eos_token_id)


def assert_no_leak(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not kv.req_to_blocks and not sched.requests
    assert not sched.running and not sched.waiting
    assert sched.make_stats().kv_cache_usage == 0.0
