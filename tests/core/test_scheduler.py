"""Scheduler: batching limits, chunked prefill, prefix caching, admission, abort."""

import random

import pytest
from core_sim import FakeRunner, assert_no_leak, make_request, make_scheduler, run_engine

from jaxlm.core.outputs import FinishReason, ModelRunnerOutput
from jaxlm.core.request import RequestStatus


def _random_requests(rng: random.Random, n: int, prefix_pool: list[list[int]]):
    reqs = []
    for i in range(n):
        prefix = rng.choice(prefix_pool) if rng.random() < 0.5 else []
        tail = [rng.randrange(100, 200) for _ in range(rng.randrange(1, 40))]
        reqs.append(make_request(f"r{i}", prefix + tail, max_tokens=rng.randrange(1, 30), ignore_eos=True))
    return reqs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "num_blocks,budget,max_seqs,caching",
    [(400, 64, 8, True), (40, 32, 4, True), (30, 16, 16, True), (30, 16, 16, False)],
)
def test_random_workload_limits_and_no_leak(seed, num_blocks, budget, max_seqs, caching):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 2000) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    reqs = _random_requests(rng, 30, prefixes)
    arrivals: dict[int, list] = {}
    for r in reqs:
        arrivals.setdefault(rng.randrange(0, 40), []).append(r)

    sched = make_scheduler(
        num_blocks, max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_prefix_caching=caching
    )
    res = run_engine(sched, FakeRunner(4), arrivals=arrivals)  # checks budget / max_num_seqs
    assert_no_leak(sched)
    stats = sched.make_stats()
    assert (stats.prefix_cache_hits > 0) == caching
    if num_blocks < 100:
        assert stats.num_preemptions > 0  # the tight configurations do exercise preemption
    assert set(res.finish) == {r.request_id for r in reqs}
    for r in reqs:
        assert len(res.outputs[r.request_id]) == r.sampling_params.max_tokens
        assert res.finish[r.request_id].finish_reason == FinishReason.LENGTH

    # The same tokens as with a cache so big nothing is ever preempted or evicted.
    ref_sched = make_scheduler(5000, max_num_seqs=64, max_num_batched_tokens=4096)
    for r in reqs:
        ref_sched.add_request(make_request(r.request_id, r.prompt_token_ids, max_tokens=r.max_tokens, ignore_eos=True))
    ref = run_engine(ref_sched, FakeRunner(4), check_blocks=False)
    assert res.outputs == ref.outputs
    assert ref_sched.make_stats().num_preemptions == 0


def test_max_num_seqs_caps_running():
    sched = make_scheduler(200, max_num_seqs=3, max_num_batched_tokens=256)
    for i in range(7):
        sched.add_request(make_request(f"r{i}", [1, 2, 3], max_tokens=5, ignore_eos=True))
    res = run_engine(sched, FakeRunner(4))  # asserts <= 3 scheduled and running every step
    assert len(res.steps[0].scheduled_new_reqs) == 3
    assert max(len(s.num_scheduled_tokens) for s in res.steps) == 3
    # FCFS: the 4th request starts only when one of the first three finished
    first_step = {n.req_id: i for i, s in enumerate(res.steps) for n in s.scheduled_new_reqs}
    assert first_step["r3"] > first_step["r2"] == 0
    assert len(res.finish) == 7
    assert_no_leak(sched)


def test_chunked_prefill_while_decoding():
    sched = make_scheduler(200, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512)
    runner = FakeRunner(4)
    sched.add_request(make_request("dec", [5, 6, 7], max_tokens=20, ignore_eos=True))
    long_prompt = list(range(300, 350))  # 50 tokens, budget 16
    res = run_engine(sched, runner, arrivals={2: [make_request("long", long_prompt, max_tokens=2, ignore_eos=True)]})
    chunk_steps = [s for s in res.steps if "long" in s.num_scheduled_tokens and s.num_scheduled_tokens["long"] > 1]
    assert len(chunk_steps) >= 4
    assert sum(s.num_scheduled_tokens["long"] for s in chunk_steps) == 50
    for s in chunk_steps:
        # the decode request keeps decoding in every step of the long prefill
        assert s.num_scheduled_tokens["dec"] == 1
        assert s.total_num_scheduled_tokens == 16 or s is chunk_steps[-1]
    # first chunk is new, later chunks are cached requests with the running total of computed tokens
    assert [n.req_id for n in chunk_steps[0].scheduled_new_reqs] == ["long"]
    later = chunk_steps[1].scheduled_cached_reqs
    assert later.num_computed_tokens[later.req_ids.index("long")] == 15
    assert len(res.outputs["long"]) == 2 and len(res.outputs["dec"]) == 20
    assert_no_leak(sched)


def test_prefix_hit_skips_tokens_and_is_counted():
    sched = make_scheduler(100, max_num_batched_tokens=64)
    runner = FakeRunner(4)
    shared = list(range(500, 518))  # 18 tokens: 4 full blocks
    sched.add_request(make_request("a", shared + [1, 2], max_tokens=3, ignore_eos=True))
    run_engine(sched, runner)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 0)

    sched.add_request(make_request("b", shared + [3, 4, 5], max_tokens=3, ignore_eos=True))
    so = sched.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 16
    assert so.num_scheduled_tokens["b"] == 21 - 16
    runner_out = runner.execute_model(so)  # the fake runner checks the hit blocks' contents
    outs = sched.update_from_output(so, runner_out)
    assert outs[0].num_cached_tokens == 16
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (41, 16)
    run_engine(sched, runner)
    assert_no_leak(sched)


def test_parallel_samples_share_prompt_blocks_across_steps():
    sched = make_scheduler(100, max_num_batched_tokens=64)
    runner = FakeRunner(4)
    prompt = list(range(700, 713))  # 3 full blocks + 1
    sched.add_request(make_request("0_p", prompt, max_tokens=4, ignore_eos=True))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))
    sched.add_request(make_request("1_p", prompt, max_tokens=4, ignore_eos=True))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    kv = sched.kv_cache_manager
    assert kv.get_block_ids("0_p")[:3] == kv.get_block_ids("1_p")[:3]
    assert [b.ref_cnt for b in kv.get_blocks("1_p")] == [2, 2, 2, 1]
    sched.update_from_output(so, runner.execute_model(so))
    run_engine(sched, runner)
    assert_no_leak(sched)


def test_parallel_samples_in_the_same_step_do_not_share():
    sched = make_scheduler(100, max_num_batched_tokens=64)
    prompt = list(range(700, 713))
    for i in range(2):
        sched.add_request(make_request(f"{i}_p", prompt, max_tokens=4, ignore_eos=True))
    so = sched.schedule()
    assert [n.num_computed_tokens for n in so.scheduled_new_reqs] == [0, 0]
    kv = sched.kv_cache_manager
    assert not set(kv.get_block_ids("0_p")) & set(kv.get_block_ids("1_p"))
    runner = FakeRunner(4)
    sched.update_from_output(so, runner.execute_model(so))
    # only one copy of each prompt block is indexed; a later request hits the first's blocks
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    sched.add_request(make_request("2_p", prompt, max_tokens=4, ignore_eos=True))
    run_engine(sched, runner)
    assert_no_leak(sched)
    assert sched.make_stats().prefix_cache_hits == 12


def test_request_that_cannot_fit_fails_alone():
    sched = make_scheduler(10, block_size=4, max_model_len=64)  # 40 cache slots
    runner = FakeRunner(4)
    sched.add_request(make_request("ok1", [1, 2, 3], max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="KV cache blocks"):
        sched.add_request(make_request("big", list(range(30)), max_tokens=20))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", list(range(60)), max_tokens=8))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("huge", list(range(64)), max_tokens=None))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", []))
    # 30 + 11 = 41 tokens, of which 40 ever need K/V: exactly the whole cache.
    sched.add_request(make_request("edge", list(range(30)), max_tokens=11, ignore_eos=True))
    sched.add_request(make_request("ok2", [4, 5], max_tokens=5, ignore_eos=True))
    assert sched.get_num_unfinished_requests() == 3
    res = run_engine(sched, runner)
    assert set(res.finish) == {"ok1", "edge", "ok2"}
    assert len(res.outputs["edge"]) == 11
    assert_no_leak(sched)


def test_max_tokens_none_caps_at_max_model_len():
    sched = make_scheduler(100, max_model_len=20)
    sched.add_request(make_request("a", list(range(15)), max_tokens=None, ignore_eos=True))
    res = run_engine(sched, FakeRunner(4))
    assert len(res.outputs["a"]) == 5 and res.finish["a"].finish_reason == FinishReason.LENGTH


def test_abort_mid_prefill_frees_blocks():
    sched = make_scheduler(50, max_num_batched_tokens=8)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(40)), max_tokens=4))
    sched.add_request(make_request("b", [1, 2, 3], max_tokens=4))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 8}
    sched.update_from_output(so, runner.execute_model(so))
    assert sched.kv_cache_manager.get_num_free_blocks() == 48
    sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # still waiting
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    assert sched.kv_cache_manager.get_num_free_blocks() == 50
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.is_empty
    assert list(sched.update_from_output(so, runner.execute_model(so))) == []
    assert sched.schedule().finished_req_ids == set()
    assert_no_leak(sched)


def test_abort_between_schedule_and_update_is_ignored():
    sched = make_scheduler(50)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    so = sched.schedule()
    out = runner.execute_model(so)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert list(sched.update_from_output(so, out)) == []
    assert_no_leak(sched)


def test_unschedulable_request_is_dropped_not_spun():
    sched = make_scheduler(4, max_model_len=64)
    bad = make_request("bad", list(range(40)), max_tokens=2)
    # Bypass add_request's check (as if the cache had shrunk): it must not loop forever.
    sched.requests["bad"] = bad
    sched.waiting.append(bad)
    sched.add_request(make_request("ok", [1, 2], max_tokens=2, ignore_eos=True))
    res = run_engine(sched, FakeRunner(4), max_steps=20)
    assert res.finish["bad"].finish_reason == FinishReason.ABORT
    assert res.finish["ok"].finish_reason == FinishReason.LENGTH
    assert_no_leak(sched)


def _reversed(mro: ModelRunnerOutput) -> ModelRunnerOutput:
    """The same step with the runner's rows in the opposite order (logprob rows follow tokens)."""
    lp = mro.logprobs
    return ModelRunnerOutput.from_lists(mro.req_ids[::-1], mro.sampled_token_ids[::-1], logprobs=type(lp)(
        lp.token_ids[::-1], lp.logprobs[::-1], lp.ranks[::-1]))


def test_logprobs_rows_follow_requests():
    sched = make_scheduler(100, max_num_batched_tokens=64)
    runner = FakeRunner(4, logprobs=True)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=3, ignore_eos=True))
    sched.add_request(make_request("b", list(range(100)), max_tokens=3, ignore_eos=True))
    so = sched.schedule()  # b is a partial prefill: a row but no token
    mro = runner.execute_model(so)
    assert mro.sampled_token_ids == [[mro.sampled_flat[0]], []] and len(mro.logprobs.ranks) == 1
    mro = _reversed(mro)  # b's empty row first: a's token and its logprobs row are still the first
    outs = {o.req_id: o for o in sched.update_from_output(so, mro)}
    assert set(outs) == {"a"}
    assert outs["a"].new_logprobs.token_ids.tolist() == [[outs["a"].new_token_ids[0], outs["a"].new_token_ids[0] + 1]]
    assert outs["a"].new_logprobs.logprobs[0, 0] == 0  # the FakeRunner's row of "a" (before the reversal)
    so = sched.schedule()
    mro = runner.execute_model(so)
    want = {rid: -mro.req_ids.index(rid) for rid in mro.req_ids}
    # rows follow the runner's order, whatever it is: reverse it
    outs = {o.req_id: o for o in sched.update_from_output(so, _reversed(mro))}
    assert set(outs) == {"a", "b"}
    for rid, o in outs.items():
        assert o.new_logprobs.logprobs[0, 0] == want[rid]
        assert o.new_logprobs.token_ids[0, 0] == o.new_token_ids[0]


def test_stats_counts():
    sched = make_scheduler(10, max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [1, 2, 3, 4, 5], max_tokens=3, ignore_eos=True))
    assert sched.make_stats().num_waiting_reqs == 3
    sched.schedule()
    s = sched.make_stats()
    assert (s.num_running_reqs, s.num_waiting_reqs) == (2, 1)
    assert s.kv_cache_usage == pytest.approx(4 / 10)


def test_token_sampled_during_a_partial_prefill_is_discarded():
    sched = make_scheduler(50, max_num_batched_tokens=8)
    sched.add_request(make_request("a", list(range(20)), max_tokens=4))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 8}
    # a runner that samples every row: the token of a prompt chunk is not an output
    assert list(sched.update_from_output(so, ModelRunnerOutput.from_lists(["a"], [[999]]))) == []
    req = sched.requests["a"]
    assert req.output_token_ids == [] and req.num_computed_tokens == 8 and req.num_tokens == 20


def test_core_does_not_import_jax():
    import subprocess
    import sys

    code = (
        "import sys, jaxlm.core.scheduler, jaxlm.core.stats; "
        "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')], 'core imports jax'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_disable_chunked_mm_input_never_ends_a_chunk_inside_an_image():
    """vLLM's disable_chunked_mm_input (set for Gemma 3, whose image tokens attend to each other):
    with a budget of 6, a 20-token prompt with images at [3, 8) and [9, 13) is prefilled in
    chunks [0, 3) [3, 9) [9, 15) [15, 20): each image whole in one step. Without it: 6-token chunks."""
    import numpy as np

    from jaxlm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def chunks(whole: bool) -> list[int]:
        sched = make_scheduler(64, max_num_batched_tokens=6)
        sched.disable_chunked_mm_input = whole
        req = make_request("r", list(range(100, 120)), max_tokens=1, ignore_eos=True)
        req.mm_features = [MultiModalFeatureSpec(np.zeros(1, np.float32), f"{i:064x}", PlaceholderRange(o, n))
                           for i, (o, n) in enumerate([(3, 5), (9, 4)])]
        sched.add_request(req)
        res = run_engine(sched, FakeRunner(4))
        assert_no_leak(sched)
        return [so.num_scheduled_tokens["r"] for so in res.steps if "r" in so.num_scheduled_tokens]

    assert chunks(True) == [3, 6, 6, 5]
    assert chunks(False) == [6, 6, 6, 2]
