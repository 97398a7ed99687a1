"""Tensor-parallel cases run on 8 CPU devices, in a subprocess of tests/executor/test_mesh_executor.py.

XLA_FLAGS must give 8 host devices before jax is imported, so this runs as its own process
(the rest of the suite keeps 1 device). Usage: ``python -m tests.helpers.mesh_cases OUT.json DIR``.
Writes, per case "family/tp": the tokens and top logprobs of a fixed prompt set under chunked
prefill and preemption, per-device bytes of weights and KV cache, the compile counter after
warm-up, the step time; plus the errors for too few devices and sizes that do not divide.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from jaxlm import LLM, SamplingParams  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402

# Small buckets keep compiles few; a 32-token budget chunks the longer prompts and 8 blocks of
# 16 tokens cannot hold 4 requests of up to 52 tokens, so requests are preempted.
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, token_buckets=[16, 32],
              seq_buckets=[4], num_gpu_blocks_override=8)
PROMPTS = [[1] + [3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((40, 9, 23, 5))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, logprobs=3)

# family -> (tensor-parallel sizes, overrides of the tiny config). 4 heads, 2 KV heads: at
# TP=4 the KV heads are replicated; vocab 322 is split by neither 4 nor (evenly) 8.
CASES = {
    "llama": ((1, 2, 4), {}),
    "qwen2": ((1, 2, 4), {}),
    "qwen3": ((1, 2), {}),
    "mistral": ((1, 2), {"sliding_window": 8}),
    "opt": ((1, 2), {}),
    "gpt2": ((1, 2), {}),
    "llama_vocab322": ((1, 4), {"vocab_size": 322}),
}


def per_device_bytes(arrays) -> int:
    """Bytes device 0 holds of these arrays (its shard of each)."""
    dev = jax.devices()[0]
    return sum(s.data.nbytes for a in jax.tree.leaves(arrays) for s in a.addressable_shards if s.device == dev)


def run_case(path: str, tp: int) -> dict:
    llm = LLM(model=path, tensor_parallel_size=tp, **ENGINE)
    params = [GREEDY, GREEDY, SEEDED, GREEDY]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    runner = llm.llm_engine.get_model_runner()
    result = dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        logprobs=[[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outs],
        weight_bytes=per_device_bytes(runner.params), kv_bytes=per_device_bytes(runner.kv_caches),
        kv_shards=runner.kv_cache_shards(),
        compiles=runner.num_compiles_after_warmup, seconds=seconds,
        preemptions=llm.llm_engine.scheduler.num_preemptions)
    del llm
    return result


def error_of(path: str, tp: int) -> str:
    try:
        LLM(model=path, tensor_parallel_size=tp, **ENGINE)
    except ValueError as e:
        return str(e)
    return ""


def main(out_path: str, work_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    results: dict = {}
    paths = {}
    for name, (tps, overrides) in CASES.items():
        family = name.split("_")[0]
        paths[name] = tm.make_tiny_model(family, os.path.join(work_dir, name), **overrides)
        for tp in tps:
            results[f"{name}/{tp}"] = run_case(paths[name], tp)
    results["errors"] = dict(too_few_devices=error_of(paths["llama"], 16), heads=error_of(paths["llama"], 8))
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
