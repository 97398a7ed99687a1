"""Sampling through the whole engine: batch-invariant seeds, logprobs equal HF's log_softmax."""

import numpy as np
import pytest
import torch
import transformers

from jaxlm import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_engine_model

LOGPROB_ATOL = 1e-4  # float32 logits of a 2-layer model differ from torch's by < 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, max_num_seqs=64, max_num_batched_tokens=256, max_model_len=128,
               token_buckets=[16, 64, 256], seq_buckets=[1, 8, 64], num_gpu_blocks_override=400, seed=123)


def _seeded(i):
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=1000 + i, max_tokens=12,
                          ignore_eos=True)


def test_seeded_outputs_are_batch_invariant(llm):
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 384, int(n)).tolist()} for n in rng.integers(2, 40, 16)]
    params = [_seeded(i) for i in range(16)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    reverse = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params[::-1], use_tqdm=False)][::-1]
    others = [{"prompt_token_ids": rng.integers(3, 384, int(n)).tolist()} for n in rng.integers(2, 40, 32)]
    other_params = [SamplingParams(temperature=1.0, max_tokens=int(m), ignore_eos=True)
                    for m in rng.integers(1, 20, 32)]
    mixed_prompts = others[:10] + prompts[:8] + others[10:] + prompts[8:]
    mixed_params = other_params[:10] + params[:8] + other_params[10:] + params[8:]
    mixed_out = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    mixed = [o.outputs[0].token_ids for o in mixed_out[10:18] + mixed_out[40:]]
    assert together == alone
    assert reverse == alone
    assert mixed == alone
    assert len({tuple(t) for t in alone}) > 1


def test_unseeded_requests_differ_but_engine_seed_repeats(model_dir, llm):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(["same prompt"] * 4, params, use_tqdm=False)]
    assert len({tuple(t) for t in first}) > 1  # unseeded requests draw different streams


def test_logprobs_match_transformers(model_dir, llm):
    prompt = [5, 77, 200, 13, 9, 310, 42]
    [out] = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True), use_tqdm=False)
    comp = out.outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + comp.token_ids])).logits[0]
    ref = torch.log_softmax(logits, -1).numpy()
    total = 0.0
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert tok == int(row.argmax())
        assert lp[tok].rank == 1
        assert abs(lp[tok].logprob - row[tok]) < LOGPROB_ATOL
        top5 = np.argsort(-row)[:5]
        assert set(top5.tolist()) <= set(lp)
        for t in top5:
            assert abs(lp[int(t)].logprob - row[t]) < LOGPROB_ATOL
        total += row[tok]
    assert abs(comp.cumulative_logprob - total) < 8 * LOGPROB_ATOL


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_transformers(model_dir, llm, chunked):
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 384, 40)]
    engine = llm
    if chunked:  # the prompt is computed over several steps: logprobs must still cover it all
        engine = LLM(model=model_dir, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                     token_buckets=[16], seq_buckets=[4])
    [out] = engine.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1).numpy()
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        entry, row = plp[p], ref[p - 1]
        assert abs(entry[prompt[p]].logprob - row[prompt[p]]) < LOGPROB_ATOL
        assert entry[prompt[p]].rank == int((row > row[prompt[p]]).sum()) + 1
        for t in np.argsort(-row)[:3]:
            assert abs(entry[int(t)].logprob - row[t]) < LOGPROB_ATOL
