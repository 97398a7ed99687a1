"""Preemption by recompute under a tiny KV cache."""

from core_sim import FakeRunner, assert_no_leak, check_block_invariants, make_request, make_scheduler, run_engine

from jaxlm.core.request import RequestStatus


def _requests():
    # Each needs 6 + 14 - 1 = 19 cached tokens = 5 blocks of 4; the cache has 8 blocks.
    return [make_request(f"r{i}", [10 * i + j for j in range(6)], max_tokens=14, ignore_eos=True) for i in range(3)]


def _reference_outputs():
    sched = make_scheduler(1000, max_num_batched_tokens=256)
    for r in _requests():
        sched.add_request(r)
    return run_engine(sched, FakeRunner(4)).outputs


def _preemption_run(enable_prefix_caching: bool):
    sched = make_scheduler(8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                           enable_prefix_caching=enable_prefix_caching)
    runner = FakeRunner(4)
    for r in _requests():
        sched.add_request(r)
    outputs: dict[str, list[int]] = {}
    preempted_with: dict[str, list[int]] = {}  # outputs at the latest preemption
    resumed: list[tuple[str, list[int], int]] = []
    num_preempt_events = 0
    for _ in range(500):
        if not sched.has_requests():
            break
        running_before = [r.request_id for r in sched.running]
        so = sched.schedule()
        if so.preempted_req_ids:
            k = len(so.preempted_req_ids)
            num_preempt_events += k
            # the newest running requests are the victims ...
            assert so.preempted_req_ids == set(running_before[-k:])
            # ... and go back to the front of the queue, oldest first
            front = [r.request_id for r in list(sched.waiting)[:k]]
            assert front == [rid for rid in running_before if rid in so.preempted_req_ids]
            for rid in so.preempted_req_ids:
                req = sched.requests[rid]
                assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
                assert rid not in sched.kv_cache_manager.req_to_blocks
                preempted_with[rid] = list(req.output_token_ids)
            assert not so.scheduled_new_reqs  # nothing is admitted in a step that preempted
        for new in so.scheduled_new_reqs:
            if new.req_id in preempted_with:
                assert new.output_token_ids == preempted_with[new.req_id]
                assert new.num_computed_tokens < len(new.prompt_token_ids) + len(new.output_token_ids)
                resumed.append((new.req_id, new.output_token_ids, new.num_computed_tokens))
        out = sched.update_from_output(so, runner.execute_model(so))
        for o in out:
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        check_block_invariants(sched)
    return sched, outputs, preempted_with, resumed, num_preempt_events


def test_preemption_recomputes_and_matches_a_big_cache():
    sched, outputs, preempted_with, resumed, events = _preemption_run(enable_prefix_caching=True)
    assert events > 0
    assert sched.make_stats().num_preemptions == events
    assert preempted_with and {rid for rid, _, _ in resumed} == set(preempted_with)
    assert any(out for _, out, _ in resumed), "a resumed request must carry its generated tokens"
    # its own blocks were freed but stay cached: the recompute starts from a prefix hit
    assert any(num_computed > 0 for _, _, num_computed in resumed)
    assert outputs == _reference_outputs()
    assert_no_leak(sched)


def test_preemption_without_prefix_caching():
    sched, outputs, preempted_with, resumed, events = _preemption_run(enable_prefix_caching=False)
    assert events > 0 and preempted_with
    assert all(num_computed == 0 for _, _, num_computed in resumed)
    assert outputs == _reference_outputs()
    assert_no_leak(sched)


def test_newest_request_preempts_itself():
    sched = make_scheduler(4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=3, ignore_eos=True))  # 2 blocks
    sched.add_request(make_request("b", list(range(50, 58)), max_tokens=5, ignore_eos=True))  # 2 full
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 6, "b": 8}
    (_, first_b) = sched.update_from_output(so, runner.execute_model(so))
    # b's 9th token needs a 5th block; b is the newest, so it is its own victim
    so = sched.schedule()
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert sched.make_stats().num_preemptions == 1
    sched.update_from_output(so, runner.execute_model(so))
    res = run_engine(sched, runner, max_steps=100)
    assert len(first_b.new_token_ids + res.outputs["b"]) == 5
    assert_no_leak(sched)


def test_oldest_request_always_progresses():
    # Both grow in a 5-block cache: the newer one is evicted (maybe repeatedly) but both finish.
    sched = make_scheduler(5, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    a = make_request("a", list(range(8)), max_tokens=12, ignore_eos=True)  # 19 tokens -> 5 blocks
    b = make_request("b", list(range(50, 58)), max_tokens=12, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    res = run_engine(sched, FakeRunner(4), max_steps=300)
    assert len(res.outputs["a"]) == 12 and len(res.outputs["b"]) == 12
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert sched.make_stats().num_preemptions == a.num_preemptions + b.num_preemptions
    assert_no_leak(sched)
