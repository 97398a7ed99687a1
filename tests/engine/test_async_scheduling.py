"""Async scheduling (--async-scheduling) changes no output: greedy and seeded sampling equal the
synchronous loop under chunked prefill, preemption and prefix caching; stop strings, stop
tokens and max_tokens end requests at the same token (nothing extra reaches the user, streamed
outputs included); no compile after warm-up; the KV cache empties."""

import pytest

from jaxlm import LLM, SamplingParams
from jaxlm.engine.async_scheduling import AsyncStepDriver
from tests.helpers.tiny_models import make_tiny_engine_model

# A 32-token budget chunks the longer prompts; 6 blocks of 16 tokens cannot hold 4 requests of
# up to ~60 tokens, so requests are preempted; prompts share a prefix (prefix caching).
ENGINE = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, token_buckets=[16, 32],
              seq_buckets=[4], num_gpu_blocks_override=6, enable_prefix_caching=True)
PREFIX = [5 + j % 200 for j in range(17)]
PROMPTS = [PREFIX + [3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((23, 2, 11, 5, 30, 8))]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))
    return {mode: LLM(model=path, async_scheduling=mode, **ENGINE) for mode in (False, True)}


def _params(stop_token: int | None = None, stop: list[str] | None = None):
    return [SamplingParams(temperature=0, max_tokens=24),
            SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=17),
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                           stop_token_ids=[stop_token] if stop_token else None),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop),
            SamplingParams(temperature=0.7, seed=5, max_tokens=9, logprobs=2)]


def _generate(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_driver_is_used_only_when_asked(engines):
    assert isinstance(engines[True].llm_engine._inproc_core()._async_driver, AsyncStepDriver)
    assert engines[False].llm_engine._inproc_core()._async_driver is None


def test_outputs_equal_the_synchronous_loop(engines):
    sync_llm, async_llm = engines[False], engines[True]
    base = _generate(sync_llm, _params())
    # A stop token and a stop string taken from the middle of the synchronous outputs.
    stop_token = base[3][0][6]
    stop_text = base[4][1][8:11]
    assert stop_text, base[4]
    params = _params(stop_token, [stop_text])
    expected = _generate(sync_llm, params)
    assert expected[3][2] == "stop" and expected[4][2] == "stop"
    got = _generate(async_llm, params)
    assert got == expected
    for llm in engines.values():
        engine = llm.llm_engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.get_model_runner().num_compiles_after_warmup == 0
        assert engine.scheduler.kv_cache_manager.usage == 0.0
        assert engine.scheduler.make_stats().prefix_cache_hits > 0


def test_streamed_outputs_never_show_an_extra_token(engines):
    params = _params(stop=["zz"])
    expected = _generate(engines[False], params)
    engine = engines[True].llm_engine
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"s{i}", {"prompt_token_ids": p}, sp)
    seen: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(list(out.outputs[0].token_ids))
    for i, (tokens, _, _) in enumerate(expected):
        stream = seen[f"s{i}"]
        assert stream[-1] == tokens
        assert all(s == tokens[:len(s)] for s in stream)  # every partial output is a prefix
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_host_in_the_loop_requests_run_synchronously(engines):
    params = [SamplingParams(temperature=0, max_tokens=12, presence_penalty=0.5, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=4)] * 3
    assert _generate(engines[True], params) == _generate(engines[False], params)
