"""Structured outputs through the real engine on a tiny random model (temperature 1, 32 seeds).

A random model emits garbage unconstrained, so a valid output is the constraint's doing. One
LLM serves every case; its KV cache is small enough that the long constrained requests preempt
each other, and its token budget (64) is below the prompt length (80), so every prompt is
prefilled in chunks before the first constrained token.
"""

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxlm import LLM, SamplingParams
from jaxlm.structured_output import StructuredOutputsParams
from tests.helpers.tiny_models import make_tiny_engine_model
from tests.structured_output.so_helpers import (
    ARITH_LARK, BOUNDED_SCHEMA, BOUNDED_SCHEMA_MAX_TOKENS, CHOICES, NUM_SEEDS, REGEX, is_arith)

PROMPT = {"prompt_token_ids": [int(t) for t in np.random.default_rng(0).integers(3, 300, size=80)]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=512)
    return LLM(model=path, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512,
               num_gpu_blocks_override=48, token_buckets=[16, 64], seq_buckets=[4, 16], seed=0)


def _run(llm, params: list[SamplingParams], prompt=PROMPT):
    return llm.generate([prompt] * len(params), params, use_tqdm=False)


def _constrained(so: StructuredOutputsParams, max_tokens: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so, **kw)
            for s in range(NUM_SEEDS)]


def _check_idle(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["kv_cache_usage_perc"] == 0.0
    assert engine.get_model_runner().num_compiles_after_warmup == 0


def test_bounded_json_schema_valid_through_preemption_and_chunked_prefill(llm):
    preemptions = llm.llm_engine.scheduler.num_preemptions
    outs = _run(llm, _constrained(StructuredOutputsParams(json=BOUNDED_SCHEMA), BOUNDED_SCHEMA_MAX_TOKENS))
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), BOUNDED_SCHEMA)
    assert len({o.outputs[0].text for o in outs}) > NUM_SEEDS // 2  # the seeds matter
    # Constrained requests were preempted mid-output and resumed (their matchers kept).
    assert llm.llm_engine.scheduler.num_preemptions > preemptions
    _check_idle(llm)


@pytest.mark.parametrize("so, valid", [
    (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    (StructuredOutputsParams(grammar=ARITH_LARK), is_arith),
], ids=["regex", "choice", "lark"])
def test_regex_choice_grammar_outputs_are_valid(llm, so, valid):
    outs = _run(llm, _constrained(so, 128))
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop" and valid(o.text), o.text
    _check_idle(llm)


def test_grammar_end_stops_over_ignore_eos_and_min_tokens(llm):
    outs = _run(llm, _constrained(StructuredOutputsParams(choice=["ab", "cd"]), 64, ignore_eos=True,
                                  min_tokens=20))
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("ab", "cd")
    _check_idle(llm)


def test_unconstrained_rows_are_batch_invariant(llm):
    free = [SamplingParams(temperature=1.0, seed=100 + s, max_tokens=24, ignore_eos=True) for s in range(6)]
    alone = [o.outputs[0].token_ids for o in _run(llm, free)]
    mixed_params = [p for pair in zip(free, _constrained(StructuredOutputsParams(regex=REGEX), 64)) for p in pair]
    mixed = _run(llm, mixed_params)
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == alone
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in mixed[1::2])
    # And unconstrained, the model does not follow the regex: the mask did the work.
    assert not all(re.fullmatch(REGEX, llm.get_tokenizer().decode(t)) for t in alone)
    _check_idle(llm)


def test_siblings_and_logprobs_under_a_constraint(llm):
    # n > 1: the siblings reuse the first child's prompt blocks (prefix-cache hits), each with
    # its own matcher. logprobs: the all-parts sampler variant; they are the model's raw ones.
    so = StructuredOutputsParams(regex=REGEX)
    [out] = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=64, logprobs=2,
                                                  structured_outputs=so), use_tqdm=False)
    assert len(out.outputs) == 4 and out.num_cached_tokens > 0
    for o in out.outputs:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
        assert len(o.logprobs) == len(o.token_ids)
        assert all(tok in step and step[tok].logprob <= 0.0 for tok, step in zip(o.token_ids, o.logprobs))
    _check_idle(llm)


@pytest.mark.parametrize("so, message", [
    (StructuredOutputsParams(regex="(unclosed"), "invalid regex constraint"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "invalid grammar constraint"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
     "invalid json constraint"),
], ids=["regex", "grammar", "json"])
def test_invalid_constraint_fails_only_its_request(llm, so, message):
    bad = SamplingParams(structured_outputs=so)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", "bad prompt"], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    _check_idle(llm)
    [out] = llm.generate(["still alive"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])), use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")


def test_structured_outputs_given_as_a_dict():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")



def test_constraint_waits_for_the_reasoning_end_token(llm):
    # The choice grammar forbids END_ID as a first token: an output that starts with it (a
    # strong bias) was decoded freely until then, and the constraint holds right after it.
    tok = llm.get_tokenizer()
    end_id = tok.encode(" fox", add_special_tokens=False)[-1]
    so = StructuredOutputsParams(choice=["ab", "cd"], reasoning_end_token_ids=[end_id])
    outs = _run(llm, _constrained(so, 16, logit_bias={end_id: 100.0})[:8])
    for out in outs:
        o = out.outputs[0]
        assert o.token_ids[0] == end_id and o.finish_reason == "stop", o.token_ids
        assert tok.decode(o.token_ids[1:]) in ("ab", "cd")
    # Without the end token the output stays unconstrained (random text runs to max_tokens).
    outs = _run(llm, _constrained(so, 8, bad_words=[tok.decode([end_id])], ignore_eos=True)[:4])
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert not all(o.outputs[0].text in ("ab", "cd") for o in outs)
    _check_idle(llm)
