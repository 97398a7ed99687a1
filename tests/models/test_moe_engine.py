"""MoE families through LLM.generate against transformers: greedy tokens equal, logprobs within
1e-4, with chunked prefill, preemption and prefix caching all at work in one engine per family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxlm import LLM, SamplingParams
from tests.helpers import tiny_models as tm

TOL = 1e-4
MAX_TOKENS = 10
# A 32-token step budget chunks the longer prompts; 14 blocks of 16 tokens cannot hold them all
# at once, so requests are preempted; the second pass reads the shared prefix from the cache.
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, token_buckets=[32], seq_buckets=[4],
              num_gpu_blocks_override=10, enable_prefix_caching=True, seed=0)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 250, 20).tolist()
    return [prefix + rng.integers(3, 250, n).tolist() for n in (41, 3, 27, 12, 35)]


def _hf_logprobs(hf, seq: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_transformers(family, tmp_path):
    path = tm.make_tiny_model(family, tmp_path / family)
    prompts = _prompts()
    llm = LLM(model=path, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions_total"] > 0
    assert stats["prefix_cache_hits"] >= 20 * (len(prompts) - 1)
    assert llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0
    worst = 0.0
    hf = tm.load_hf_model(path)
    for p, out, out2 in zip(prompts, first, again):
        toks = list(out.outputs[0].token_ids)
        assert list(out2.outputs[0].token_ids) == toks
        ref = _hf_logprobs(hf, p + toks)[len(p) - 1:]
        # Greedy: each token is HF's argmax given the same history (teacher forced).
        assert toks == [int(t) for t in ref.argmax(-1)[:len(toks)]], family
        for step, lp in enumerate(out.outputs[0].logprobs):
            for tok, v in lp.items():
                worst = max(worst, abs(v.logprob - ref[step, tok]))
    print(f"{family}: max |logprob - HF| {worst:.2e}")
    assert worst < TOL
