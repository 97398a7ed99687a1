"""decode_update (the numpy-free form of the usual decode step) gives what the array path gives.

The same workloads run twice, step by step, through the sync Scheduler and the AsyncScheduler:
once as shipped, once with decode_update.try_update switched off (every step through
step_update's array path). Every step's outputs (tokens, finish and stop reasons) and the
requests' end states must be equal, and the fast path must have taken most steps.
Workloads: EOS, stop ids, min_tokens holding them back, ignore_eos, max_tokens,
max_model_len, shared prompts (prefix-cache blocks registered as they fill), preemption.
"""

from __future__ import annotations

import random
import zlib

import pytest
from core_sim import FakeRunner, assert_no_leak, make_request, make_scheduler

from jaxlm.config import CacheConfig, SchedulerConfig
from jaxlm.core import decode_update
from jaxlm.core.async_scheduler import AsyncScheduler
from jaxlm.core.outputs import ModelRunnerOutput

EOS, STOP = 2, 3


def _token(req_id: str, position: int) -> int:
    """Mostly ordinary tokens, sometimes EOS or a stop id (both ignored by some requests)."""
    h = zlib.crc32(f"{req_id}:{position}".encode()) % 100
    return EOS if h < 4 else STOP if h < 8 else 100 + h


def _requests(seed: int, n: int = 24) -> list:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 200) for _ in range(9)]
    reqs = []
    for i in range(n):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 30))]
        params = dict(max_tokens=rng.choice([1, 2, 5, 17, 40, None]), min_tokens=rng.choice([0, 0, 3]),
                      ignore_eos=rng.random() < 0.2, stop_token_ids=[STOP] if rng.random() < 0.5 else None)
        params["min_tokens"] = min(params["min_tokens"], params["max_tokens"] or 99)  # None: to max_model_len
        reqs.append(make_request(f"r{seed}-{i}", prompt, eos_token_id=EOS, **params))
    return reqs


def _counting(monkeypatch, enabled: bool) -> dict:
    """Switch the fast path on or off; count the steps it took."""
    taken = {"fast": 0, "all": 0, "fast_finishes": 0, "fast_stop_ids": 0}
    real = decode_update.try_update

    def try_update(sched, so, mro):
        taken["all"] += 1
        out = real(sched, so, mro) if enabled else None
        if out is not None:
            taken["fast"] += 1
            taken["fast_finishes"] += len(out.finish_reasons)
            taken["fast_stop_ids"] += len(out.stop_reasons)
        return out

    monkeypatch.setattr(decode_update, "try_update", try_update)
    return taken


def _record(sched, out) -> tuple:
    """A step's outputs and the prefix cache's registered blocks after it."""
    return ([(o.req_id, o.new_token_ids, o.finish_reason, o.stop_reason) for o in out],
            dict(sched.kv_cache_manager.num_cached_block))


def _sync_run(seed: int, num_blocks: int) -> tuple[list, dict]:
    sched = make_scheduler(num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=80)
    runner = FakeRunner(4, token_fn=_token)
    reqs = _requests(seed)
    arrivals = {2 * i: [r] for i, r in enumerate(reqs)}
    steps, step = [], 0
    while sched.has_requests() or arrivals:
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        so = sched.schedule()
        out = sched.update_from_output(so, runner.execute_model(so))
        steps.append(_record(sched, out))
        step += 1
    assert_no_leak(sched)
    return steps, {r.request_id: (r.output_token_ids, r.status, r.stop_reason) for r in reqs}


def _async_run(seed: int, num_blocks: int) -> tuple[list, dict]:
    cache = CacheConfig(block_size=4, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    sched = AsyncScheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=80,
                                           async_scheduling=True), cache)
    reqs = _requests(seed)
    arrivals = {2 * i: [r] for i, r in enumerate(reqs)}
    steps, step, in_flight = [], 0, None
    while sched.has_requests() or arrivals or in_flight:
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        before = {rid: r.num_output_placeholders for rid, r in sched.requests.items()}
        so = sched.schedule()
        ids, tokens = [], []
        for rid in so.num_scheduled_tokens:  # a request samples when the step added a placeholder
            req = sched.requests[rid]
            ids.append(rid)
            samples = req.num_output_placeholders > before.get(rid, 0)
            tokens.append([_token(rid, req.num_tokens + req.num_output_placeholders - 1)] if samples else [])
        if in_flight is not None:
            out = sched.update_from_output(*in_flight)
            steps.append(_record(sched, out))
        in_flight = (so, ModelRunnerOutput.from_lists(ids, tokens)) if ids or so.finished_req_ids else None
        step += 1
        assert step < 5000
    return steps, {r.request_id: (r.output_token_ids, r.status, r.stop_reason) for r in reqs}


@pytest.mark.parametrize("run", [_sync_run, _async_run], ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [200, 40], ids=["roomy", "preempting"])
def test_fast_path_matches_the_array_path(monkeypatch, run, num_blocks):
    total: dict[str, int] = {}
    for seed in range(4):
        with monkeypatch.context() as m:
            taken = _counting(m, enabled=True)
            fast = run(seed, num_blocks)
        with monkeypatch.context() as m:
            _counting(m, enabled=False)
            slow = run(seed, num_blocks)
        assert fast[0] == slow[0]
        assert fast[1] == slow[1]
        for k, v in taken.items():
            total[k] = total.get(k, 0) + v
    # The fast path really ran, and ended requests itself (stop ids among them).
    assert total["fast"] > total["all"] // 3 and total["fast_finishes"] > 10 and total["fast_stop_ids"], total
