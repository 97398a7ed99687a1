"""A MoE GGUF with its experts in blocks against the same file dequantized at load.

    python scripts/dev/gguf_moe_bench.py [--workdir DIR]

A random Qwen3-MoE-shaped model (hidden 1024, 4 layers, 32 experts of 512, top-4), written as
GGUF with the experts' gate/up in Q4_1, down in Q8_0 and the Linears in Q8_0; decode tok/s at
batch 1 and 16 (33 greedy tokens minus 1, after a warm-up) and the weight bytes, for
``--quantization gguf`` (the default) and ``none``. --workdir keeps the files between runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None, help="where the model is written (default: a temporary directory)")
    args = p.parse_args()
    import gguf

    from jaxlm import LLM, SamplingParams
    from tests.helpers import gguf_moe, tiny_models

    q = gguf.GGMLQuantizationType
    root = args.workdir or tempfile.mkdtemp(prefix="gguf_moe_bench_")
    src, path = os.path.join(root, "src"), os.path.join(root, "gguf", "model.gguf")
    if not os.path.exists(path):
        tiny_models.make_tiny_model("qwen3_moe", src, hidden_size=1024, moe_intermediate_size=512, num_experts=32,
                                    num_experts_per_tok=4, num_hidden_layers=4, mlp_only_layers=[],
                                    intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                                    head_dim=128, vocab_size=320)
        gguf_moe.write(src, os.path.dirname(path),
                       lambda n: q.Q4_1 if re.search(r"ffn_(gate|up)_exps", n) else q.Q8_0, "qwen3_moe")
    for quant in ("gguf", "none"):
        llm = LLM(model=path, tokenizer=src, quantization=quant, max_num_seqs=16, max_model_len=128,
                  max_num_batched_tokens=128)
        wb = llm.llm_engine.engine_config.model_config.weight_bytes
        for bs in (1, 16):
            prompts = [{"prompt_token_ids": [1] + [3 + (i * 7 + j) % 300 for j in range(8)]} for i in range(bs)]
            many = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
            one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            llm.generate(prompts, many, use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            t1 = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(prompts, many, use_tqdm=False)
            t33 = time.perf_counter() - t0
            print(f"{quant}: weight bytes {wb}, batch {bs}: {bs * 32 / (t33 - t1):.1f} decode tok/s", flush=True)
        del llm


if __name__ == "__main__":
    main()
