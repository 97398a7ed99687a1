"""Greedy LLM.generate equals transformers' greedy generate, token for token, in every engine mode."""

import numpy as np
import pytest
import torch
import transformers

from jaxlm import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_engine_model

MAX_TOKENS = 24


def _prompts(seed: int, lengths, shared_prefix: int = 0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 384, shared_prefix).tolist()
    return [prefix + rng.integers(3, 384, n).tolist() for n in lengths]


def _hf_greedy(path, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_tiny_engine_model(request.param, path)


# (engine kwargs, prompt lengths, shared prefix); each case must show its mechanism at work.
CASES = {
    "default": (dict(), [3, 7, 12, 16, 17, 25, 33, 48, 5], 0),
    "prefix_caching": (dict(enable_prefix_caching=True), [3, 9, 14, 20, 1, 30, 6, 11], 40),
    "chunked_prefill": (dict(max_num_batched_tokens=32, token_buckets=[8, 16, 32]), [70, 3, 45, 12, 90, 8, 33, 51], 0),
    "preemption": (dict(num_gpu_blocks_override=14, max_model_len=224), [20, 31, 15, 40, 26, 9, 33, 18], 0),
}


# Every mode on Llama; Qwen2 (biases, its own config) in the default one: the modes are the
# scheduler's and the KV cache's, the same code for every family.
KEYS = [("llama", case) for case in CASES] + [("qwen2", "default")]


@pytest.mark.parametrize("model_dir,case", KEYS, ids=[f"{f}-{c}" for f, c in KEYS], indirect=["model_dir"])
def test_greedy_matches_transformers(model_dir, case):
    kwargs, lengths, prefix = CASES[case]
    prompts = _prompts(len(lengths), lengths, prefix)
    expected = _hf_greedy(model_dir, prompts)
    engine_kwargs = dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256, seed=0)
    engine_kwargs.update(kwargs)
    llm = LLM(model=model_dir, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if case == "prefix_caching":
        # A second pass re-reads the shared prefix (and whole prompts) from the cache.
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, exp, prompt in zip(outputs, expected, prompts):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == exp, f"prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason in ("stop", "length")
    stats = llm.llm_engine.get_stats()
    if case == "prefix_caching":
        assert stats["prefix_cache_hits"] >= 40 * (len(prompts) - 1)
        assert outputs[-1].num_cached_tokens > 0
    if case == "preemption":
        assert stats["num_preemptions_total"] > 0
    # Nothing leaks: every block is back in the pool once all requests are done.
    assert stats["kv_cache_usage_perc"] == 0.0
    assert llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0
