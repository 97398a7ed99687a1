"""Prompt logprobs reach the client once per position, across chunks and mid-prefill preemption."""

import numpy as np
import pytest

from jaxlm import LLM, SamplingParams
from jaxlm.core.outputs import LogprobsLists
from jaxlm.worker.prompt_logprobs import PromptLogprobsTracker
from tests.helpers.tiny_models import make_tiny_engine_model


def _rows(first_pos: int, n: int) -> LogprobsLists:
    # Row j stands for position first_pos + j, so the test can read back which were returned.
    pos = np.arange(first_pos, first_pos + n)
    return LogprobsLists(pos[:, None].repeat(2, 1), pos[:, None].astype(np.float32).repeat(2, 1), pos)


def test_tracker_returns_each_position_once_across_a_recompute():
    t = PromptLogprobsTracker()
    t.add_request("r", num_prompt_tokens=10)  # positions 0..8 predict tokens 1..9
    assert t.take("r", 0, 4, _rows(0, 4)).ranks.tolist() == [0, 1, 2, 3]
    assert t.take("r", 4, 3, _rows(4, 3)).ranks.tolist() == [4, 5, 6]
    # Preempted: the request registers again and recomputes from its first token.
    t.add_request("r", num_prompt_tokens=10)
    assert t.wanted(["x", "r"]) == [1]
    assert t.take("r", 0, 5, _rows(0, 5)).ranks.tolist() == []
    assert t.take("r", 5, 4, _rows(5, 4)).ranks.tolist() == [7, 8]
    # The last prompt token predicts the first output: no row; then nothing is owed.
    assert t.take("r", 9, 1, _rows(9, 1)).ranks.tolist() == []
    assert t.wanted(["r"]) == []
    t.add_request("r", num_prompt_tokens=10)  # resumed after its prompt: still nothing owed
    assert t.wanted(["r"]) == []
    t.finish_request("r")
    assert "r" not in t and len(t) == 0


def test_tracker_refuses_a_hole_instead_of_shifting_rows(caplog):
    t = PromptLogprobsTracker()
    t.add_request("r", num_prompt_tokens=10)
    t.take("r", 0, 2, _rows(0, 2))
    assert t.take("r", 5, 2, _rows(5, 2)).ranks.tolist() == []
    assert "never computed" in caplog.text
    assert t.wanted(["r"]) == []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))


def _run(model_dir, num_blocks, prompts, params):
    llm = LLM(model=model_dir, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128,
              token_buckets=[16], seq_buckets=[2], num_gpu_blocks_override=num_blocks)
    runner = llm.llm_engine.get_model_runner()
    registered = []
    execute = runner.execute_model

    def spy(so, **kw):
        registered.extend((n.req_id, len(n.output_token_ids)) for n in so.scheduled_new_reqs)
        return execute(so, **kw)

    runner.execute_model = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, registered, llm.llm_engine.get_stats()


def test_prompt_logprobs_once_per_position_under_preemption(model_dir):
    rng = np.random.default_rng(0)
    short, long = rng.integers(3, 384, 10).tolist(), rng.integers(3, 384, 100).tolist()
    prompts = [{"prompt_token_ids": short}, {"prompt_token_ids": long}]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)]
    # 8 blocks of 16: the long prompt (7 blocks) is chunked 15 tokens a step beside the short
    # one's decode, and is preempted (newest) each time the decode needs a block.
    outs, registered, stats = _run(model_dir, 8, prompts, params)
    ref, _, ref_stats = _run(model_dir, 64, prompts, params)
    long_id = outs[1].request_id  # the client's id; the core sees "<client id>-<serial>"
    mid_prefill = [n for r, n in registered if r.rsplit("-", 1)[0] == long_id and n == 0]
    assert stats["num_preemptions_total"] > 0 and len(mid_prefill) > 1, registered
    assert ref_stats["num_preemptions_total"] == 0
    plp, ref_plp = outs[1].prompt_logprobs, ref[1].prompt_logprobs
    assert len(plp) == len(long) and plp[0] is None
    for p in range(1, len(long)):
        assert plp[p].keys() == ref_plp[p].keys() and long[p] in plp[p]
        for tok, lp in plp[p].items():
            assert abs(lp.logprob - ref_plp[p][tok].logprob) < 1e-4, (p, tok)
    assert outs[1].outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
