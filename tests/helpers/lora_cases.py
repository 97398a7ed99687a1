"""LoRA under tensor parallel on 8 CPU devices, in a subprocess of tests/lora/test_lora_tp.py.

XLA_FLAGS must give 8 host devices before jax is imported, so this runs as its own process.
Usage: ``python -m tests.helpers.lora_cases OUT.json DIR``. Writes, per case "family/tp", the
greedy tokens and logprobs of base and adapter prompts mixed in one generate (chunked, more
adapters than slots), the compile counter after warm-up (adapter loads included), the slot
loads; and for GPT-2 (its fused c_attn adapter split over q/k/v) transformers + peft's tokens.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402

from jaxlm import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402
from tests.helpers.lora_adapters import ALL_MODULES, PeftReference, make_peft_adapter  # noqa: E402

ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=96,
              max_num_batched_tokens=32, token_buckets=[32], seq_buckets=[4], async_scheduling=False)
PROMPTS = [[1] + [3 + (13 * i + 3 * j) % 250 for j in range(n)] for i, n in enumerate((40, 9, 23, 5, 17))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
# llama: 2 KV heads, so TP=4 repeats them (the k/v adapters' B columns are repeated the same way).
CASES = {"llama": (1, 2, 4), "gpt2": (2,)}
ADAPTERS = {
    "llama": [dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]),
              dict(r=8, lora_alpha=4, use_rslora=True, target_modules=ALL_MODULES),
              dict(r=2, lora_alpha=16, target_modules=["k_proj", "v_proj", "o_proj", "gate_proj"])],
    "gpt2": [dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"]),
             dict(r=8, lora_alpha=4, target_modules=["c_attn", "c_proj"])],
}


def run_case(base: str, adapters: list[str], tp: int) -> dict:
    llm = LLM(model=base, tensor_parallel_size=tp, **ENGINE)
    loras = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    per_prompt = [loras[i % len(loras)] for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=per_prompt, use_tqdm=False)
    runner = llm.llm_engine.get_model_runner()
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                logprobs=[[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]
                          for o in outs],
                compiles=runner.num_compiles_after_warmup, slot_loads=runner.lora.num_slot_loads,
                adapters=[lr.lora_path if lr else None for lr in per_prompt])


def main(out_path: str, work: str) -> None:
    results = {}
    for family, tps in CASES.items():
        base = tm.make_tiny_model(family, os.path.join(work, family))
        adapters = [make_peft_adapter(base, os.path.join(work, f"{family}_a{i}"), seed=i + 1, **kw)
                    for i, kw in enumerate(ADAPTERS[family])]
        for tp in tps:
            results[f"{family}/{tp}"] = run_case(base, adapters, tp)
        if family == "gpt2":
            ref = PeftReference(base)
            results["gpt2/hf"] = {"tokens": [ref.greedy(a, p, GREEDY.max_tokens)[0] for p, a in
                                             zip(PROMPTS, results["gpt2/2"]["adapters"])]}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
