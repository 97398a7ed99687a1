"""Expert-parallel cases on 8 CPU devices, in a subprocess of tests/models/test_moe_parallel.py.

Usage: ``python -m tests.helpers.moe_cases OUT.json DIR``. One tiny Qwen2-MoE (8 experts, top-2,
a shared expert, a dense layer between sparse ones) served at TP=1, EP=2, EP=4 and TP=2 without
EP under chunked prefill and preemption; per case the tokens and top logprobs, the compile
counter after warm-up and the bytes device 0 holds of the expert weights and of the rest. Then
10 and 6 experts at EP=4, which 4 does not divide (3, 3, 2, 2 and 2, 2, 1, 1 experts per
device), their greedy tokens beside transformers' on the same weights (one device's reference,
without compiling a second engine); plus the errors for sizes that still must divide.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxlm import LLM, SamplingParams  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402
from tests.helpers.mesh_cases import PROMPTS, per_device_bytes  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, token_buckets=[32],
              seq_buckets=[4], num_gpu_blocks_override=8)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, logprobs=3)
# name -> (tensor_parallel_size, enable_expert_parallel)
CASES = {"tp1": (1, False), "ep2": (2, True), "ep4": (4, True), "tp2": (2, False)}


def run_case(path: str, tp: int, ep: bool) -> dict:
    llm = LLM(model=path, tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [GREEDY, GREEDY, SEEDED, GREEDY], use_tqdm=False)
    runner = llm.llm_engine.get_model_runner()
    expert_arrays = [v.get_value() for path, v in nnx.to_flat_state(runner.params) if "experts" in path]
    result = dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        logprobs=[[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outs],
        expert_bytes=per_device_bytes(expert_arrays), weight_bytes=per_device_bytes(runner.params),
        compiles=runner.num_compiles_after_warmup, preemptions=llm.llm_engine.scheduler.num_preemptions)
    del llm
    return result


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (n tokens, EOS not special)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def uneven_case(path: str) -> dict:
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(model=path, tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    runner = llm.llm_engine.get_model_runner()
    expert_arrays = [v.get_value() for path, v in nnx.to_flat_state(runner.params) if "experts" in path]
    result = dict(tokens=[list(o.outputs[0].token_ids) for o in outs], expert_bytes=per_device_bytes(expert_arrays),
                  compiles=runner.num_compiles_after_warmup, preemptions=llm.llm_engine.scheduler.num_preemptions)
    del llm
    result["hf_tokens"] = [hf_greedy(path, p, 10) for p in PROMPTS]
    return result


def error_of(path: str, tp: int, ep: bool) -> str:
    try:
        LLM(model=path, tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE)
    except ValueError as e:
        return str(e)
    return ""


def main(out_path: str, work_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    path = tm.make_tiny_model("qwen2_moe", os.path.join(work_dir, "qwen2_moe"), num_experts=8)
    results: dict = {name: run_case(path, tp, ep) for name, (tp, ep) in CASES.items()}
    for experts in (10, 6):
        uneven = tm.make_tiny_model("qwen2_moe", os.path.join(work_dir, f"e{experts}"), num_experts=experts)
        results[f"e{experts}"] = uneven_case(uneven)
    odd = tm.make_tiny_model("qwen2_moe", os.path.join(work_dir, "odd"), num_experts=6, moe_intermediate_size=30)
    # Whole experts need not divide; an expert's slices (TP without EP) and attention heads do.
    results["errors"] = dict(intermediate=error_of(odd, 4, False), heads=error_of(odd, 8, True))
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
