"""The scheduler with speculative decoding, against a fake runner that checks every K/V it reads.

SpecFakeRunner writes K/V at every scheduled position, drafts included, and accepts the leading
drafts that equal the "model's" token (token_fn); a rejected draft's K/V stays in its slot. Any
read of a position the scheduler counts as computed must find the true token there, so a missing
rollback, a block cached with a rejected draft in it (a later prefix hit reads it) or a slot
reused wrongly fails the step. Outputs must equal a run without speculation, token for token.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from jaxlm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxlm.core.async_scheduler import AsyncScheduler
from jaxlm.core.outputs import ModelRunnerOutput
from jaxlm.core.scheduler import Scheduler
from jaxlm.core.sched_output import SchedulerOutput
from tests.core.core_sim import FakeRunner, assert_no_leak, default_token_fn, make_request, run_engine


def draft_fn(req_id: str, position: int) -> int:
    """The proposer's guess at a position: right about 70% of the time."""
    if zlib.crc32(f"d{req_id}:{position}".encode()) % 10 < 7:
        return default_token_fn(req_id, position)
    return 6000 + position


class SpecFakeRunner(FakeRunner):
    def __init__(self, block_size: int, k: int, draft=draft_fn):
        super().__init__(block_size)
        self.k = k
        self.draft = draft
        self.verified: list[tuple[str, int, int]] = []  # (req, drafts, accepted) per verify

    def run_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        writes = {}
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            start, drafts = st.num_computed, so.scheduled_spec_decode_tokens.get(rid, [])
            seq = st.tokens + list(drafts)
            assert start + n == len(seq) if drafts else start + n <= len(st.tokens), (rid, start, n)
            assert len(st.block_ids) * self.block_size >= start + n, "not enough blocks"
            for pos in range(start):
                got = self.kv.get(self._slot(st, pos))
                assert got == (st.tokens[pos], pos), f"{rid}: bad K/V at position {pos}: {got}"
            for pos in range(start, start + n):
                writes[self._slot(st, pos)] = (seq[pos], pos)
        self.kv.update(writes)
        req_ids, sampled, spec = [], [], []
        for rid, n in so.num_scheduled_tokens.items():
            st, drafts = self.reqs[rid], so.scheduled_spec_decode_tokens.get(rid, [])
            req_ids.append(rid)
            if st.num_computed + n < len(st.tokens) + len(drafts):  # a prefill chunk
                st.num_computed += n
                sampled.append([])
                spec.append([])
                continue
            out, L = [], len(st.tokens)
            for j in range(len(drafts) + 1):
                out.append(self.token_fn(rid, L + j))
                if j == len(drafts) or drafts[j] != out[-1]:
                    break
            if drafts:
                self.verified.append((rid, len(drafts), len(out) - 1))
            st.num_computed = L - 1 + len(out)
            st.tokens.extend(out)
            sampled.append(out)
            spec.append([self.draft(rid, len(st.tokens) + j) for j in range(self.k)])
        return ModelRunnerOutput.from_lists(req_ids, sampled, spec_token_ids=spec if so.propose_draft_tokens else None)


def _scheduler(k: int, num_blocks: int, budget: int, *, cls=Scheduler, disable_by_batch_size=None,
               max_model_len: int = 256, method: str = "ngram", policy: str = "fcfs") -> Scheduler:
    cache = CacheConfig(block_size=4, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    sched = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=max_model_len,
                            scheduling_policy=policy)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model="m" if method == "draft_model" else None,
                             disable_by_batch_size=disable_by_batch_size)
    return cls(sched, cache, speculative_config=spec)


def _requests(eos_from: dict[str, int] | None = None):
    """Prompts sharing prefixes (later ones extend earlier ones: prefix hits on generated blocks)."""
    rng = np.random.default_rng(0)
    base = rng.integers(100, 5000, 30).tolist()
    prompts = {f"r{i}": base[: 5 + 7 * i] for i in range(4)}
    prompts["r4"] = rng.integers(100, 5000, 45).tolist()
    prompts["r5"] = base + [default_token_fn("r0", 5 + j) for j in range(6)]
    reqs = []
    for i, (rid, prompt) in enumerate(prompts.items()):
        eos = default_token_fn(rid, len(prompt) + eos_from[rid]) if eos_from and rid in eos_from else None
        reqs.append(make_request(rid, prompt, eos_token_id=eos, max_tokens=9 + 5 * i))
    return reqs


def _reference(num_blocks: int, budget: int, eos_from=None) -> dict[str, list[int]]:
    cache = CacheConfig(block_size=4, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=256), cache)
    return run_engine(sched, FakeRunner(4), {0: _requests(eos_from)[:3], 3: _requests(eos_from)[3:]}).outputs


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("case", ["prefix_caching", "preemption", "chunked_prefill"])
def test_outputs_equal_no_speculation(k, case):
    num_blocks, budget = {"prefix_caching": (200, 64), "preemption": (22, 64), "chunked_prefill": (200, 5)}[case]
    eos_from = {"r1": 4, "r3": 7}  # an eos a few tokens in: often inside an accepted run
    sched = _scheduler(k, num_blocks, budget, cls=AsyncScheduler if k == 3 else Scheduler)
    runner = SpecFakeRunner(4, k)
    result = run_engine(sched, runner, {0: _requests(eos_from)[:3], 3: _requests(eos_from)[3:]})
    assert result.outputs == _reference(num_blocks, budget, eos_from)
    for rid, out in result.finish.items():
        req = next(r for r in _requests(eos_from) if r.request_id == rid)
        assert len(result.outputs[rid]) <= req.max_tokens  # no token past max_tokens
        if req.eos_token_id is not None and req.eos_token_id in result.outputs[rid]:
            assert result.outputs[rid][-1] == req.eos_token_id and str(out.finish_reason) == "stop"
    assert_no_leak(sched)
    # The counters follow what was verified.
    stats = sched.make_stats().spec_decoding_stats
    assert stats.num_drafts == len(runner.verified) > 0
    assert stats.num_draft_tokens == sum(d for _, d, _ in runner.verified)
    assert stats.num_accepted_tokens == sum(a for _, _, a in runner.verified) > 0
    per_pos = stats.num_accepted_tokens_per_pos
    assert len(per_pos) == k and sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    if case == "preemption":
        assert sched.num_preemptions > 0
    if case == "prefix_caching":
        assert sched.kv_cache_manager.prefix_cache_stats.hits > 0
    # Drafts count against the budget, and every step holds at most 1 + k tokens per request.
    for so in result.steps:
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            assert 0 < len(drafts) <= k and so.num_scheduled_tokens[rid] == 1 + len(drafts)


def test_eos_and_max_tokens_inside_an_accepted_run():
    """Every draft right: the runs are k + 1 long, and eos / max_tokens cut them."""
    sched = _scheduler(4, 200, 64)
    runner = SpecFakeRunner(4, 4, draft=default_token_fn)
    prompt = list(range(100, 110))
    eos = default_token_fn("e", len(prompt) + 7)  # the 8th output: inside the second run
    sched.add_request(make_request("e", prompt, eos_token_id=eos, max_tokens=40))
    sched.add_request(make_request("m", prompt, max_tokens=8))  # the 8th output ends a run early
    result = run_engine(sched, runner)
    assert result.outputs["e"] == [default_token_fn("e", len(prompt) + j) for j in range(8)]
    assert result.outputs["m"] == [default_token_fn("m", len(prompt) + j) for j in range(8)]
    assert str(result.finish["e"].finish_reason) == "stop" and str(result.finish["m"].finish_reason) == "length"
    # Drafts past max_tokens are never even scheduled: "m" computes its prompt and 7 outputs, no more.
    assert sum(so.num_scheduled_tokens.get("m", 0) for so in result.steps) == len(prompt) + 8 - 1
    assert any(len(so.scheduled_spec_decode_tokens.get("m", [])) == 4 for so in result.steps)
    assert_no_leak(sched)


def test_priority_preemption_of_a_request_already_scheduled(monkeypatch):
    """Under --scheduling-policy priority the victim may be a request scheduled earlier in the
    same step: its drafts leave the step with its tokens."""
    from jaxlm.core.sched_output import CachedRequestData

    undone = []
    remove = CachedRequestData.remove
    monkeypatch.setattr(CachedRequestData, "remove", lambda self, rid: undone.append(rid) or remove(self, rid))
    sched = _scheduler(3, 22, 64, policy="priority")
    reqs = _requests()
    for i, r in enumerate(reqs):  # the earliest admitted are the worst: victims scheduled before
        r.priority = len(reqs) - i
    result = run_engine(sched, SpecFakeRunner(4, 3), {0: reqs[:3], 3: reqs[3:]})
    assert result.outputs == _reference(22, 64)
    assert undone and sched.num_preemptions > 0
    for so in result.steps:
        assert set(so.scheduled_spec_decode_tokens) <= set(so.num_scheduled_tokens)
    assert_no_leak(sched)


def test_disable_by_batch_size_and_sync_steps():
    sched = _scheduler(3, 200, 64, cls=AsyncScheduler, disable_by_batch_size=3)
    for r in _requests()[:4]:
        sched.add_request(r)
    so = sched.schedule()  # 4 waiting, 0 running when the step starts: it speculates
    assert so.propose_draft_tokens and sched.needs_sync_step()
    sched.update_from_output(so, SpecFakeRunner(4, 3).execute_model(so))
    so = sched.schedule()  # 4 running >= 3: no drafts, no proposals, steps may overlap
    assert not so.propose_draft_tokens and not so.scheduled_spec_decode_tokens
    assert not sched.needs_sync_step()


def test_lookahead_slots_for_a_draft_model():
    sched = _scheduler(3, 200, 64, method="draft_model", max_model_len=40)
    sched.add_request(make_request("a", list(range(100, 110)), max_tokens=20))
    so = sched.schedule()
    # 10 prompt tokens + 3 lookahead slots: 4 blocks of 4.
    assert len(sched.kv_cache_manager.get_blocks("a")) == 4 and so.num_scheduled_tokens["a"] == 10
