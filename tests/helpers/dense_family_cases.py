"""The dense families (Gemma 3, Phi-3, SmolLM3, Granite) under the engine, on 8 CPU devices: a
subprocess of tests/models/test_dense_families_engine.py (XLA_FLAGS must give 8 host devices
before jax is imported). Usage: ``python -m tests.helpers.dense_family_cases OUT.json DIR``.

One LLM per (family, TP size) serves a prompt set twice: a 32-token budget chunks the long
prompts, 9 KV blocks of 16 tokens cannot hold the 4 requests at once (preemption), and the
prompts share a 20-token prefix, which the second pass also reads back whole from the prefix
cache. Writes, per case "family/tp", each pass's tokens and the logprob of each sampled token,
with the engine's preemption and prefix-hit counts and the compile counter after warm-up.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

from jaxlm import LLM, SamplingParams  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, token_buckets=[16, 32],
              seq_buckets=[4], num_gpu_blocks_override=9, enable_prefix_caching=True)
_PREFIX = [3 + (11 * j) % 240 for j in range(20)]
PROMPTS = [_PREFIX + [3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((26, 2, 13, 31))]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)

# family -> (tensor-parallel sizes, overrides of its tiny config). Phi-3 with one KV head: at
# TP=2 the fused qkv tensor is split and its KV head repeated per device.
CASES = {
    "gemma3": ((2,), {}),
    "phi3": ((2,), {"num_key_value_heads": 1}),
    "smollm3": ((2,), {}),
    "granite": ((2,), {}),
}


def run_case(path: str, tp: int) -> dict:
    llm = LLM(model=path, tensor_parallel_size=tp, **ENGINE)
    passes = []
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        passes.append(dict(
            tokens=[list(o.outputs[0].token_ids) for o in outs],
            logprobs=[[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                      for o in outs]))
    stats = llm.llm_engine.get_stats()
    result = dict(passes=passes, preemptions=stats["num_preemptions_total"],
                  prefix_hits=stats["prefix_cache_hits"], kv_usage=stats["kv_cache_usage_perc"],
                  compiles=llm.llm_engine.get_model_runner().num_compiles_after_warmup)
    del llm
    return result


def main(out_path: str, work_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    results: dict = {}
    for family, (tps, overrides) in CASES.items():
        path = tm.make_tiny_model(family, os.path.join(work_dir, family), **overrides)
        results[f"{family}/path"] = path
        for tp in tps:
            results[f"{family}/{tp}"] = run_case(path, tp)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
