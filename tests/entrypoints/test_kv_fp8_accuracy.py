"""What an fp8 KV cache costs in accuracy, the user's question, on a small trained Llama: the
embedded default (SmolLM2-135M-Instruct), float32 weights, its float32 cache against fp8 (e4m3)
with --calculate-kv-scales (the checkpoint ships no scales; with 1.0 the figures were alike: 3 of
20 prompts kept, drift mean 0.050 nats, docs/PERF_NOTES.md, session 9). Random tiny models are no measure here: their next-token
logits are nearly tied, so any perturbation flips greedy choices (even a bfloat16 cache keeps
only 13 of 20 prompts' 64 tokens on the tiny random Llama; docs/PERF_NOTES.md, session 9)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxlm import LLM, SamplingParams

pytestmark = pytest.mark.timeout(1800)

PROMPTS = ["The capital of France is", "Hello, my name is", "The largest ocean is", "Once upon a time,",
           "In 1492, Columbus", "The recipe for pancakes calls for", "Water boils at", "The theory of relativity",
           "My favourite programming language is", "The best way to learn is", "Photosynthesis is the process",
           "The stock market today", "A haiku about autumn:", "The first step in solving", "Dogs are loyal because",
           "The meaning of life is", "To make a website, you", "The moon orbits", "Shakespeare wrote",
           "Machine learning is"]
NEW_TOKENS = 32  # the measured first differences (median 14.5) fall inside it; half the decode of 64
# Bounds: the measured figures (docs/PERF_NOTES.md, session 9: first differences at a median of
# 14.5 tokens, 2 of 20 prompts identical; drift mean 0.055, max 0.77 nats) with some margin, so
# that a regression shows. The aim, 90% of prompts identical over 64 tokens, is NOT met
# on this 135M model with per-tensor e4m3 scales; these bounds record what is.
FIRST_DIFF_MEDIAN_MIN = 8  # greedy tokens before a prompt's first difference, median over prompts
DRIFT_MEAN_MAX = 0.08  # mean |logprob(fp8) - logprob(f32)| of the teacher-forced tokens, nats
DRIFT_MAX_MAX = 1.5  # the largest single token's


def _engine(**kw) -> LLM:
    return LLM(max_num_seqs=20, max_model_len=256, max_num_batched_tokens=64, token_buckets=[64],
               seq_buckets=[20], seed=0, **kw)


def _run(llm: LLM, texts: list[list[int]] | None = None):
    """(greedy tokens of each prompt, the texts scored, their teacher-forced logprobs)."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    texts = texts or [o.prompt_token_ids + t for o, t in zip(outs, tokens)]
    scored = llm.generate([{"prompt_token_ids": t} for t in texts],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    lps = np.concatenate([[lp[tok].logprob for tok, lp in zip(t[1:], o.prompt_logprobs[1:])]
                          for t, o in zip(texts, scored)])
    return tokens, texts, lps


def test_fp8_greedy_tokens_and_logprob_drift_against_the_float_cache():
    ref, texts, ref_lps = _run(_engine())  # texts: the float cache's own continuations
    got, _, lps = _run(_engine(kv_cache_dtype="fp8", calculate_kv_scales=True), texts)
    same = sum(a == b for a, b in zip(ref, got))
    first_diff = sorted(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), NEW_TOKENS)
                        for a, b in zip(ref, got))
    drift = np.abs(lps - ref_lps)
    print(f"fp8 vs f32 KV on SmolLM2-135M: {same}/{len(PROMPTS)} prompts' {NEW_TOKENS} greedy tokens equal "
          f"(first difference at {first_diff}); teacher-forced logprob drift mean {drift.mean():.4f} "
          f"max {drift.max():.4f} nats over {drift.size} tokens")
    assert np.median(first_diff) >= FIRST_DIFF_MEDIAN_MIN
    assert drift.mean() < DRIFT_MEAN_MAX and drift.max() < DRIFT_MAX_MAX
