"""jaxlm's two GGUF paths held to llama.cpp's numbers on the same file.

    python scripts/dev/gguf_vs_llamacpp.py [--model FILE.gguf] [--greedy-tokens 48] [--skip-greedy]

Needs llama-cpp-python (0.3.36 builds from source in ~9 minutes on 2 cores, so this is a
benchmark-side check, not a CI test). Two measurements:

1. Teacher-forced logits over real text (five passages, ~70 tokens each). Each passage is fed one
   token a step, which is how a decode step runs: jaxlm ``--quantization gguf`` (blocks: the C++
   kernel on activations rounded to int8 per block of 32) and ``none`` (every tensor dequantized
   to float32 at load), against llama.cpp's logits (``logits_all``, one ``eval`` of the passage).
   Per pair: top-1 agreement, the mean KL divergence of the next-token distributions, and the
   largest difference in the log-probability of the text's own next token.
2. Greedy continuations of chat prompts: how many of jaxlm's (per path) equal llama.cpp's, token
   for token, and where the first difference falls.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PASSAGES = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used to make wine.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place mostly in the leaves, inside small structures called chloroplasts.",
    "To make a simple tomato sauce, warm olive oil in a pan, add chopped garlic and cook it gently until "
    "it smells sweet, then add crushed tomatoes, a pinch of salt and a few basil leaves.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "The Pacific Ocean is the largest and deepest of Earth's oceans. It covers about one third of the "
    "planet's surface and reaches its greatest depth in the Mariana Trench.",
]
CHATS = [
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Write a haiku about autumn.", "Explain what a prime number is.", "How do I boil an egg?",
    "Name the planets of the solar system.", "What is 17 times 23?", "Why is the sky blue?",
]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def jaxlm_logits(model_file: str, quantization: str, passages: list[list[int]]) -> list[np.ndarray]:
    """Each passage fed one token a step through the model (decode-shaped steps), its logits."""
    import jax
    from flax import nnx

    from jaxlm.attention.backends import get_attention_backend
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import get_model, resolve_model_config
    from tests.helpers.paged_batch import PagedBatchBuilder, make_kv_caches

    lc = LoadConfig()
    mc = resolve_model_config(ModelConfig(model=model_file, quantization=quantization), lc)
    model = get_model(mc, lc, attn_backend=get_attention_backend("cpu"))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, pos, caches, md):
        m = nnx.merge(graphdef, state)
        h, caches = m(ids, pos, caches, md)
        return m.compute_logits(h), caches

    out = []
    for ids in passages:
        pages = -(-len(ids) // 16)
        pb = PagedBatchBuilder(num_blocks=pages + 1, block_size=16, max_pages_per_seq=pages)
        caches = make_kv_caches(type(model).get_kv_cache_spec(mc.hf_config), pages + 1, 16)
        rows = []
        for t in ids:
            tok, pos, md = pb.step({0: [t]})
            logits, caches = step(state, tok, pos, caches, md)
            rows.append(np.asarray(logits)[0])
        out.append(np.stack(rows))
    return out


def llamacpp_logits(llm, passages: list[list[int]]) -> list[np.ndarray]:
    out = []
    for ids in passages:
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[:len(ids)], dtype=np.float32))
    return out


def compare(a: list[np.ndarray], b: list[np.ndarray], passages: list[list[int]]) -> dict[str, float]:
    la, lb = (np.concatenate([_log_softmax(x[:-1]) for x in side]) for side in (a, b))
    nxt = np.concatenate([np.asarray(ids[1:]) for ids in passages])
    rows = np.arange(len(nxt))
    kl = (np.exp(la) * (la - lb)).sum(-1)
    return {"top1_agree": float(np.mean(la.argmax(-1) == lb.argmax(-1))), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "text_logprob_max_diff": float(np.abs(la[rows, nxt] - lb[rows, nxt]).max()),
            "positions": int(len(nxt))}


def greedy_jaxlm(model_file: str, quantization: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from jaxlm import LLM, SamplingParams

    llm = LLM(model=model_file, quantization=quantization, max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=256, token_buckets=[8, 256], seq_buckets=[8])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy_llamacpp(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    res = []
    for p in prompts:
        llm.reset()
        toks = []
        for t in llm.generate(p, temp=0.0, top_k=1, reset=True):
            toks.append(int(t))
            if len(toks) >= n:
                break
        res.append(toks)
    return res


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model's)")
    ap.add_argument("--greedy-tokens", type=int, default=48)
    ap.add_argument("--skip-greedy", action="store_true")
    ap.add_argument("--skip-logits", action="store_true")
    args = ap.parse_args()
    from llama_cpp import Llama

    from jaxlm.model_loader import get_tokenizer, resolve_model_config
    from jaxlm.config import LoadConfig, ModelConfig

    mc = resolve_model_config(ModelConfig(model=args.model), LoadConfig())
    model_file = mc.model
    tok = get_tokenizer(mc)
    passages = [tok(p)["input_ids"] for p in PASSAGES]
    from bench_gguf_e2e import llama_cpp_without_amx

    llama_cpp_without_amx()
    llm = Llama(model_path=model_file, n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=512,
                logits_all=True, verbose=False)
    if not args.skip_logits:
        ref = llamacpp_logits(llm, passages)
        sides = {q: jaxlm_logits(model_file, q, passages) for q in ("gguf", "none")}
        print(f"model {model_file}; {sum(len(p) - 1 for p in passages)} teacher-forced positions, one token a step")
        for q, got in sides.items():
            print(f"  jaxlm {q:>4} vs llama.cpp: {compare(ref, got, passages)}")
        print(f"  jaxlm gguf vs jaxlm none: {compare(sides['none'], sides['gguf'], passages)}")
    if args.skip_greedy:
        return
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
             for c in CHATS]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    want = greedy_llamacpp(llm, prompts, args.greedy_tokens)
    for q in ("gguf", "none"):
        got = greedy_jaxlm(model_file, q, prompts, args.greedy_tokens)
        diffs = [first_diff(w, g) for w, g in zip(want, got)]
        same = sum(d >= args.greedy_tokens for d in diffs)
        print(f"  greedy, {len(prompts)} chat prompts x {args.greedy_tokens} tokens: jaxlm {q} equals llama.cpp on "
              f"{same}; first differences at {sorted(diffs)}")
        for c, w, g in zip(CHATS, want, got):
            print(f"    {c!r}\n      llama.cpp: {tok.decode(w)!r}\n      jaxlm {q}: {tok.decode(g)!r}")


if __name__ == "__main__":
    main()
