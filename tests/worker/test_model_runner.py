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


def test_cudagraph_mode_sets_the_command_buffers_of_the_programs_it_names(llm, monkeypatch, caplog):
    """compilation_config's cudagraph_mode reaches each step program's .compile() as XLA's
    command-buffer options, on a GPU only: the platform is made "gpu" and the compile recorded
    (this XLA:CPU checks each style's option names and values below)."""
    from jaxlm.worker import compile_jobs
    from jaxlm.worker.command_buffers import STYLES

    runner = llm.llm_engine.get_model_runner()
    comp = runner.config.compilation_config
    seen = {}
    monkeypatch.setattr(compile_jobs, "compile_lowered", lambda lowered, options, fresh: seen.setdefault("o", options))
    bodies, samplers = dict(runner._body), dict(runner._sample)
    picked = {("body", (16, "mixed")), ("body", (64, "mixed")), ("body", (64, "prompt_logprobs")),
              ("sample", (2, runner.sampling.variants()[0]))}

    def options_per_program(platform: str, mode: str | None, only=picked) -> dict:
        monkeypatch.setattr(compile_jobs, "runner_platform", lambda r: platform)
        monkeypatch.setattr(comp, "cudagraph_mode", mode)
        out = {}
        for job in runner.compile_jobs():
            if (job.table, job.key) in only:
                seen.clear()
                job()
                out[(job.table, job.key[0], job.key[1] if job.table == "body" else "")] = seen["o"]
        return out

    try:
        full, none, piece = STYLES["full"], STYLES["none"], STYLES["piecewise"]
        # The XLA backend has no decode bodies: decode steps (<= max_num_seqs 8 tokens) run mixed 16.
        assert options_per_program("gpu", "FULL_DECODE_ONLY") == {
            ("body", 16, "mixed"): full, ("body", 64, "mixed"): none, ("body", 64, "prompt_logprobs"): none,
            ("sample", 2, ""): full}
        mixed64 = {("body", (64, "mixed"))}
        sampler = {k for k in picked if k[0] == "sample"}
        assert list(options_per_program("gpu", "FULL_AND_PIECEWISE", mixed64).values()) == [piece]
        assert list(options_per_program("gpu", "NONE", sampler).values()) == [none]
        assert list(options_per_program("gpu", None, mixed64).values()) == [{}]  # XLA's defaults
        assert list(options_per_program("cpu", "FULL", sampler).values()) == [{}]  # no command buffers on CPU
    finally:
        runner._body.update(bodies), runner._sample.update(samplers)
    with caplog.at_level("INFO", logger="jaxlm.worker.compile_jobs"):
        compile_jobs.log_cudagraph_mode(runner)
    assert "cudagraph_mode=FULL has no effect on cpu" in caplog.text
    lowered = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(4))
    for style in STYLES.values():  # names and enum values this XLA knows (a typo fails to compile)
        lowered.compile(compiler_options=style)
