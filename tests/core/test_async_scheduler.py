"""AsyncScheduler: placeholders for tokens in flight, computed counts advanced at schedule time,
no step wasted past max_tokens, a late EOS discards the token computed meanwhile, and a request
preempted with a token in flight keeps it."""

from core_sim import assert_no_leak, make_request

from jaxlm.config import CacheConfig, SchedulerConfig
from jaxlm.core.async_scheduler import AsyncScheduler, needs_host_in_loop
from jaxlm.core.outputs import ModelRunnerOutput
from jaxlm.core.request import RequestStatus
from jaxlm.sampling_params import SamplingParams


def _scheduler(num_blocks=64, **kw) -> AsyncScheduler:
    cache = CacheConfig(block_size=4, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    sched = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, async_scheduling=True)
    sched.update(kw)
    return AsyncScheduler(SchedulerConfig(**sched), cache)


def _out(tokens: dict[str, int]) -> ModelRunnerOutput:
    ids = list(tokens)
    return ModelRunnerOutput.from_lists(ids, [[tokens[r]] for r in ids])


def test_placeholders_and_max_tokens():
    s = _scheduler()
    r = make_request("r", [7] * 5, max_tokens=3, ignore_eos=True)
    s.add_request(r)
    so1 = s.schedule()  # prefill: samples token 1
    assert so1.num_scheduled_tokens == {"r": 5} and r.num_computed_tokens == 5 and r.num_output_placeholders == 1
    so2 = s.schedule()  # before step 1's token is back: decodes on the placeholder
    assert so2.num_scheduled_tokens == {"r": 1} and r.num_computed_tokens == 6 and r.num_output_placeholders == 2
    assert [o.new_token_ids for o in s.update_from_output(so1, _out({"r": 11}))] == [[11]]
    assert r.num_output_placeholders == 1 and r.num_computed_tokens == 6
    so3 = s.schedule()  # token 3, the last one max_tokens allows
    assert so3.num_scheduled_tokens == {"r": 1}
    s.update_from_output(so2, _out({"r": 12}))
    so4 = s.schedule()  # 2 outputs + 1 in flight = max_tokens: nothing to schedule
    assert so4.num_scheduled_tokens == {}
    [last] = s.update_from_output(so3, _out({"r": 13}))
    assert last.new_token_ids == [13] and last.finish_reason is not None
    assert r.output_token_ids == [11, 12, 13]
    s.update_from_output(so4, ModelRunnerOutput.empty())
    s.schedule()  # tells the runner the request finished
    assert_no_leak(s)


def test_late_eos_discards_the_token_in_flight():
    s = _scheduler()
    r = make_request("r", [7] * 5, eos_token_id=2, max_tokens=10)
    s.add_request(r)
    so1 = s.schedule()
    so2 = s.schedule()
    [o] = s.update_from_output(so1, _out({"r": 2}))  # EOS: finished one step late
    assert o.new_token_ids == [2] and r.status == RequestStatus.FINISHED_STOPPED
    assert list(s.update_from_output(so2, _out({"r": 99}))) == []  # never shown
    assert r.output_token_ids == [2]
    s.schedule()
    assert_no_leak(s)


def test_preempted_request_keeps_its_token_in_flight():
    # 4 blocks of 4 tokens: two requests of 7 + up to 4 tokens cannot both grow.
    s = _scheduler(num_blocks=4, max_model_len=16)
    a = make_request("a", [5] * 7, max_tokens=4, ignore_eos=True)
    b = make_request("b", [6] * 7, max_tokens=4, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    so1 = s.schedule()  # both prefill (2 blocks each) and sample
    so2 = s.schedule()  # both decode position 7 on their placeholders: fits in 2 blocks each
    so3 = s.schedule()  # position 8 needs a third block: b (newest) is preempted
    assert so3.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    s.update_from_output(so1, _out({"a": 21, "b": 31}))
    s.update_from_output(so2, _out({"a": 22, "b": 32}))
    assert b.output_token_ids == [31, 32]  # both arrived after the preemption, both kept
    steps = [so3]
    for _ in range(20):
        if not s.has_requests():
            break
        steps.append(s.schedule())
        so = steps.pop(0)
        s.update_from_output(so, _out({rid: 40 + len(s.requests[rid].output_token_ids)
                                       for rid in so.num_scheduled_tokens if rid in s.requests
                                       and s.requests[rid].num_output_placeholders}))
    assert a.output_token_ids[:2] == [21, 22] and len(a.output_token_ids) == 4
    assert b.output_token_ids[:2] == [31, 32] and len(b.output_token_ids) == 4
    assert_no_leak(s)


def test_needs_host_in_loop():
    assert not needs_host_in_loop(SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=2))
    assert needs_host_in_loop(SamplingParams(presence_penalty=0.5))
    assert needs_host_in_loop(SamplingParams(min_tokens=2))
