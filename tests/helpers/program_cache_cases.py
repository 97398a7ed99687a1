"""Engine starts for tests/worker/test_program_cache.py, in a fresh process whose JAX
compilation cache is the test's own (empty) directory, so the first start compiles every
program itself. Usage: python -m tests.helpers.program_cache_cases MODEL CACHE_DIR OUT_JSON [eight]
("eight": one start in a process that sees eight host devices, where the cache is off)."""

import glob
import json
import os
import sys

from jaxlm import LLM, SamplingParams

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, num_gpu_blocks_override=24,
              seed=0, token_buckets=[32], seq_buckets=[4])
PROMPTS = [{"prompt_token_ids": [1, 5, 9, 13, 2]}, {"prompt_token_ids": [2, 7, 3]}]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=3, logprobs=2, ignore_eos=True)]


def start(model: str, cache_dir: str, **over) -> dict:
    llm = LLM(model=model, compilation_cache_dir=cache_dir, **{**ENGINE, **over})
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    runner = llm.llm_engine.get_model_runner()
    result = dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                  logprobs=[sorted((t, lp.logprob) for t, lp in step.items()) for step in outs[1].outputs[0].logprobs],
                  from_cache=runner.programs_from_cache, programs=runner.num_programs,
                  compiles=runner.num_compiles_after_warmup)
    del llm
    result["files"] = sorted(glob.glob(os.path.join(cache_dir, "jaxlm-programs", "*.pkl")))
    return result


def start_deferred(model: str, cache_dir: str) -> dict:
    """A warm start that defers its programs: loaded on first use, then the rest one by one."""
    llm = LLM(model=model, compilation_cache_dir=cache_dir, defer_program_load=True, **ENGINE)
    runner = llm.llm_engine.get_model_runner()
    loaded = lambda: len(runner._body) + len(runner._sample)  # noqa: E731
    at_start = loaded()
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    after_requests, idle_loads = loaded(), 0
    while runner.load_deferred_program():
        idle_loads += 1
    result = dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                  logprobs=[sorted((t, lp.logprob) for t, lp in step.items()) for step in outs[1].outputs[0].logprobs],
                  from_cache=runner.programs_from_cache, programs=runner.num_programs,
                  compiles=runner.num_compiles_after_warmup, at_start=at_start, after_requests=after_requests,
                  idle_loads=idle_loads, at_end=loaded(), pending=runner.deferred_loads.pending())
    del llm
    result["files"] = sorted(glob.glob(os.path.join(cache_dir, "jaxlm-programs", "*.pkl")))
    return result


def main(model: str, cache_dir: str, out: str, mode: str = "") -> None:
    if mode == "eight":
        with open(out, "w") as f:
            json.dump(start(model, cache_dir), f)
        return
    results = {"first": start(model, cache_dir), "second": start(model, cache_dir)}
    results["deferred"] = start_deferred(model, cache_dir)
    # Another config (one more sequence bucket): its body programs come from JAX's cache.
    results["other"] = start(model, cache_dir, seq_buckets=[2, 4])
    with open(results["first"]["files"][0], "wb") as f:
        f.write(b"\x80\x05not a pickle")
    results["torn"] = start(model, cache_dir)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
