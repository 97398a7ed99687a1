"""compile_in_background (worker/background_compile.py) through LLM: a cold start compiles the
largest buckets' programs, serves on them while a thread compiles the rest, and samples what an
engine that compiled everything first samples; plus the bucket bookkeeping on its own."""

from __future__ import annotations

import pytest

from jaxlm import LLM, SamplingParams
from jaxlm.worker.background_compile import CompileJob, ReadyBuckets, background_order
from jaxlm.worker.step_programs import DECODE, MIXED, PROMPT_LOGPROBS
from tests.helpers.tiny_models import make_tiny_engine_model

# Three token buckets (1, 8, 32) and two sequence buckets (1, 4): the serving set is the 1- and
# 32-token bodies and the 4-row samplers; the 8-token body and the 1-row samplers compile later.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_gpu_blocks_override=40, seed=0,
              token_buckets=[1, 8, 32], seq_buckets=[1, 4], compilation_cache_dir="")
PROMPTS = [{"prompt_token_ids": list(range(1, 1 + n))} for n in (3, 20, 70)]
PARAMS = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.8, top_k=5, seed=3, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)]


def _samples(outputs) -> list[tuple]:
    def lps(steps):
        return [sorted((t, lp.logprob) for t, lp in step.items()) if step else None for step in steps or []]
    return [(list(o.outputs[0].token_ids), lps(o.outputs[0].logprobs), lps(o.prompt_logprobs)) for o in outputs]


def _assert_same(got: list[tuple], want: list[tuple]) -> None:
    # Another padding may round differently in the last bits; the tokens are the same.
    for (tokens, lps, plps), (w_tokens, w_lps, w_plps) in zip(got, want, strict=True):
        assert tokens == w_tokens
        for a, b in zip(lps + plps, w_lps + w_plps, strict=True):
            assert (a is None) == (b is None)
            for (ta, la), (tb, lb) in zip(a or [], b or [], strict=True):
                assert ta == tb and la == pytest.approx(lb, abs=1e-5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_engine_model("llama", tmp_path_factory.mktemp("bg") / "tiny")


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model=model, **ENGINE)
    runner = llm.llm_engine.get_model_runner()
    assert runner.background is None and runner.ready.complete()
    return _samples(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


def test_a_cold_start_serves_on_the_largest_buckets_while_the_rest_compile(model, reference):
    llm = LLM(model=model, compile_in_background=True, **ENGINE)
    runner = llm.llm_engine.get_model_runner()
    background = runner.background
    background.stop()  # hold the thread: serve on what the start compiled (plus at most one more)
    assert runner.num_programs == 3 + 2 + 2 * 6  # mixed 1, 8, 32, prompt logprobs 1, 32, 6 variants x 2
    assert len(background.done) <= 1 and background.pending >= 7
    assert runner.ready.bodies[MIXED] == [1, 32] and runner.ready.bodies[PROMPT_LOGPROBS] == [32]
    assert runner.ready.seqs == [4]  # no 1-row sampler variant set is complete yet
    held = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    _assert_same(_samples(held), reference)
    assert runner.padding.samples > runner.padding.real_samples  # 1-row steps took the 4-row samplers

    background.start()  # the rest compile while the same requests run again
    _assert_same(_samples(llm.generate(PROMPTS, PARAMS, use_tqdm=False)), reference)
    assert background.wait(300) and background.error is None and runner.ready.complete()
    _assert_same(_samples(llm.generate(PROMPTS, PARAMS, use_tqdm=False)), reference)
    # The thread's compiles are not the step's: the guard counts none.
    assert runner.num_compiles_after_warmup == 0


def _jobs(ready: ReadyBuckets) -> list[CompileJob]:
    jobs = [CompileJob("body", (T, kind), lambda fresh: None) for kind, b in ready.body_buckets.items() for T in b]
    return jobs + [CompileJob("sample", (S, v), lambda fresh: None) for S in ready.seq_buckets for v in "abc"]


def test_ready_buckets_pick_the_smallest_compiled_one():
    ready = ReadyBuckets({MIXED: [1, 8, 64], DECODE: [1, 8], PROMPT_LOGPROBS: [8, 64]}, [1, 4, 16], "abc")
    jobs = _jobs(ready)
    ready.reset()
    serving = ready.serving_set(jobs)
    assert sorted(j.key for j in serving if j.table == "body") == [(1, MIXED), (64, MIXED), (64, PROMPT_LOGPROBS)]
    assert [j.key for j in serving if j.table == "sample"] == [(16, v) for v in "abc"]
    for job in serving:
        ready.publish(job)
    assert ready.body(MIXED, 1) == (1, MIXED) and ready.body(MIXED, 2) == (64, MIXED) and ready.seq(1) == 16
    assert ready.body(DECODE, 3) == (64, MIXED)  # no decode body yet: the mixed one
    later = sorted((j for j in jobs if j not in serving), key=background_order)
    # Batch-1 decode first: its samplers; then by size, decode bodies after the mixed ones.
    assert [j.key for j in later[:3]] == [(1, v) for v in "abc"]
    assert [j.key for j in later if j.table == "body"] == [(8, MIXED), (1, DECODE), (8, DECODE), (8, PROMPT_LOGPROBS)]
    for job in later[:2]:
        ready.publish(job)
    assert ready.seq(1) == 16  # 2 of 3 variants: not yet
    ready.publish(later[2])
    assert ready.seq(1) == 1 and not ready.complete()
    for job in later[3:]:
        ready.publish(job)
    assert ready.complete() and ready.body(DECODE, 3) == (8, DECODE)
    with pytest.raises(ValueError, match="65 tokens exceed"):
        ready.body(MIXED, 65)
