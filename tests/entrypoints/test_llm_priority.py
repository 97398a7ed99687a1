"""Priority scheduling through LLM / LLMEngine: start order, preemption victim, refusals."""

import pytest

from jaxlm import SamplingParams
from jaxlm.core.request import RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["alpha beta", "gamma delta", "the quick fox", "hello there", "one two three"]


def test_one_slot_runs_requests_in_priority_order_with_unchanged_outputs(priority_llm):
    scheduler = priority_llm.llm_engine.scheduler
    reference = priority_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # One sequence slot (the same engine, so no other compiled programs): requests run one at a time.
    scheduler.max_num_seqs = 1
    try:
        outs = priority_llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[3, 1, 2, -5, 1])
    finally:
        scheduler.max_num_seqs = 8
    started = sorted(range(len(PROMPTS)), key=lambda i: outs[i].metrics.scheduled_ts)
    assert started == [3, 1, 4, 2, 0]  # lower first; the two 1s by arrival
    # Each ran alone and finished before the next started.
    for a, b in zip(started, started[1:]):
        assert outs[a].metrics.last_token_ts <= outs[b].metrics.scheduled_ts
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    # n > 1 siblings keep their request's priority: all three run before the priority-0 request.
    scheduler.max_num_seqs = 1
    try:
        outs = priority_llm.generate(["zero", "first"], [GREEDY, SamplingParams(n=3, temperature=0, max_tokens=4)],
                                     use_tqdm=False, priority=[0, -1])
    finally:
        scheduler.max_num_seqs = 8
    assert outs[0].metrics.scheduled_ts > outs[1].metrics.last_token_ts
    assert len(outs[1].outputs) == 3


def test_kv_pressure_preempts_the_low_priority_request(priority_llm):
    """40 blocks of 16; 8 requests of up to 120 tokens need 8 blocks each: decodes preempt. The
    low-priority request is admitted first (so it is not the newest), yet it is the victim."""
    engine = priority_llm.llm_engine
    scheduler = engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=112, ignore_eos=True)
    prompts = [f"request {i} goes" for i in range(8)]
    # The reference: four at a time fit in the cache, no preemption.
    reference = [o.outputs[0].token_ids for half in (prompts[:4], prompts[4:])
                 for o in priority_llm.generate(half, params, use_tqdm=False)]
    preemptions = scheduler.num_preemptions
    low = engine.add_request("low", prompts[0], params, priority=1)
    engine.step()
    high = [engine.add_request(f"high{i}", p, params) for i, p in enumerate(prompts[1:], 1)]
    first_victims, outputs = None, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if first_victims is None and scheduler.num_preemptions > preemptions:
            first_victims = {rid for rid, r in scheduler.requests.items() if r.status == RequestStatus.PREEMPTED}
    assert first_victims == {low}, (first_victims, high)
    assert [outputs["low"]] + [outputs[f"high{i}"] for i in range(1, 8)] == reference
    assert engine.get_stats()["kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("priority,message", [
    (2 ** 63, "priority must fit in 64 bits"),
    (-(2 ** 63) - 1, "priority must fit in 64 bits"),
    (1.5, "priority must be an integer"),
    (True, "priority must be an integer"),
    ("1", "priority must be an integer"),
])
def test_bad_priority_fails_alone(priority_llm, priority, message):
    with pytest.raises(ValueError, match=message):
        priority_llm.generate(["fine", "bad"], GREEDY, use_tqdm=False, priority=[0, priority])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        priority_llm.generate(["one"], GREEDY, use_tqdm=False, priority=[0, 1])
    [out] = priority_llm.generate(["still serving"], GREEDY, use_tqdm=False, priority=[2 ** 63 - 1])
    assert len(out.outputs[0].token_ids) == 8
    assert not priority_llm.llm_engine.has_unfinished_requests()
