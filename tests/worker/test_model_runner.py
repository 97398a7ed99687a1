"""Warm-up compiles every program; a mixed workload afterwards compiles nothing (and the guard can tell)."""

import jax
import jax.numpy as jnp
import pytest

from jaxlm import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_engine_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_engine_model("qwen2", tmp_path_factory.mktemp("qwen2"))
    return LLM(model=path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
               token_buckets=[16, 64], seq_buckets=[2, 8], num_gpu_blocks_override=64)


def _mixed_workload(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=7),
        SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=5, logprobs=3),
        SamplingParams(temperature=0, logit_bias={5: 3.0}, min_tokens=3, max_tokens=6),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4),
    ] * 3
    prompts = ["short", "a somewhat longer prompt " * 3, "x " * 40, "The capital of France is", "hi"] * 3
    return llm.generate(prompts, params, use_tqdm=False)


def test_program_count_is_a_sum(llm):
    runner = llm.llm_engine.get_model_runner()
    # len(token_buckets) bodies + decode bodies (none: the xla backend has no decode kernel)
    # + prompt-logprobs bodies (every other token bucket from the top: [64])
    # + 6 x len(seq_buckets) sampler variants.
    assert runner.decode_buckets == [] and runner.prompt_logprobs_buckets == [64]
    assert runner.num_programs == 2 + 0 + 1 + 2 * 6


def test_no_compile_after_warmup(llm):
    runner = llm.llm_engine.get_model_runner()
    outs = _mixed_workload(llm)
    assert all(o.finished for o in outs)
    assert runner.num_compiles_after_warmup == 0


def test_guard_counts_a_compile_inside_a_step(llm, monkeypatch):
    runner = llm.llm_engine.get_model_runner()
    before = runner.num_compiles_after_warmup
    original = runner._device_inputs
    fresh = jax.jit(lambda x: x * 3 + 1)

    def compiling_device_inputs(*args):
        fresh(jnp.arange(7))  # a program nobody compiled ahead
        return original(*args)

    monkeypatch.setattr(runner, "_device_inputs", compiling_device_inputs)
    llm.generate(["one more"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert runner.num_compiles_after_warmup > before
