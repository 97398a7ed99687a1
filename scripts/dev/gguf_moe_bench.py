"""Decode tok/s of a random Qwen3-MoE-shaped GGUF (hidden 1024, 4 layers, 32 experts of 512, top-4;
experts gate/up Q4_1, down Q8_0, Linears Q8_0) with the experts in blocks (default) against the
same file dequantized at load (--quantization none), batch 1 and 16. Run from the repository root."""
import os, re, sys, time
import gguf
from tests.helpers import tiny_models as tm, gguf_moe as gm
from jaxlm import LLM, SamplingParams
_Q = gguf.GGMLQuantizationType
root = "/tmp/moegguf_work/bench"
src = os.path.join(root, "src")
if not os.path.exists(os.path.join(root, "gguf", "model.gguf")):
    tm.make_tiny_model("qwen3_moe", src, hidden_size=1024, moe_intermediate_size=512, num_experts=32,
                       num_experts_per_tok=4, num_hidden_layers=4, mlp_only_layers=[], intermediate_size=1024,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=320)
    t = lambda n: _Q.Q4_1 if re.search(r"ffn_(gate|up)_exps", n) else _Q.Q8_0
    gm.write(src, os.path.join(root, "gguf"), t, "qwen3_moe")
path = os.path.join(root, "gguf", "model.gguf")
for quant in ("gguf", "none"):
    llm = LLM(model=path, tokenizer=src, quantization=quant, max_num_seqs=16, max_model_len=128,
              max_num_batched_tokens=128)
    wb = llm.llm_engine.engine_config.model_config.weight_bytes
    for bs in (1, 16):
        prompts = [{"prompt_token_ids": [1] + [3 + (i * 7 + j) % 300 for j in range(8)]} for i in range(bs)]
        p = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, p, use_tqdm=False)
        p1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter(); llm.generate(prompts, p1, use_tqdm=False); t1 = time.perf_counter() - t0
        t0 = time.perf_counter(); llm.generate(prompts, p, use_tqdm=False); t33 = time.perf_counter() - t0
        print(f"{quant} weight_bytes={wb} batch={bs} decode tok/s={bs * 32 / (t33 - t1):.1f}", flush=True)
    del llm
