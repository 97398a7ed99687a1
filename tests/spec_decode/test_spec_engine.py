"""Speculative decoding through LLM(...): outputs equal the engine without it, for each proposer
and k = 1, 3, 5.

One tiny model, one engine without speculation (its outputs cached per case) and one per
(proposer, k). The draft model is the target itself, so every greedy draft is accepted and runs
are k + 1 tokens long. The engines share one configuration that makes every mechanism happen:
a 32-token budget (prompts are chunked), a KV cache too small for the batch (preemption), shared
prompt prefixes (prefix-cache hits). The tokenizer's EOS is rewritten to a token the model emits
a few tokens in, so EOS can end a request inside an accepted run.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from jaxlm import LLM, SamplingParams
from jaxlm.metrics.reader import Counter, Vector
from jaxlm.sampling_params import RequestOutputKind
from tests.helpers.tiny_models import make_tiny_engine_model

MAX_TOKENS = 24
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[32], max_model_len=128,
              num_gpu_blocks_override=14, enable_prefix_caching=True, seed=0)
SPECS = [("ngram", 1), ("ngram", 3), ("ngram", 5), ("draft_model", 1), ("draft_model", 3), ("draft_model", 5)]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 380, 20).tolist()
    lengths = [5, 45, 12, 33, 9, 70, 17, 3]
    return [(shared if i % 3 == 0 else []) + rng.integers(3, 380, n).tolist() for i, n in enumerate(lengths)]


def _set_eos(path: str) -> int:
    """Make the tokenizer's EOS a token the model greedily emits a few tokens into the first prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = _prompts()[0]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    # An odd index: never the last token of a draft=target run (those end at multiples of k + 1 = 2, 4, 6).
    index = next(i for i in range(3, len(out), 2) if out[i] not in out[:i])
    tok = AutoTokenizer.from_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token"] = tok.convert_ids_to_tokens(out[index])
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return out[index]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_engine_model("llama", tmp_path_factory.mktemp("spec"))
    _set_eos(path)
    return path


class Base:
    """The engine without speculation; each case's outputs computed once."""

    def __init__(self, path: str):
        self.llm = LLM(model=path, seq_buckets=[8], **ENGINE)
        self.cache: dict[str, list] = {}

    def run(self, name: str, prompts, params):
        if name not in self.cache:
            self.cache[name] = self.llm.generate(prompts, params, use_tqdm=False)
        return self.cache[name]


@pytest.fixture(scope="module")
def base(model_dir):
    return Base(model_dir)


@pytest.fixture(scope="module", params=SPECS, ids=[f"{m}-k{k}" for m, k in SPECS])
def spec(request, model_dir):
    method, k = request.param
    cfg = {"method": method, "num_speculative_tokens": k}
    cfg.update({"model": model_dir} if method == "draft_model" else {"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    llm = LLM(model=model_dir, speculative_config=cfg, seq_buckets=[32], **ENGINE)
    llm.k, llm.method = k, method
    return llm


def _counters(llm: LLM) -> dict[str, object]:
    return {m.name: (m.values if isinstance(m, Vector) else m.value) for m in llm.get_metrics()
            if isinstance(m, (Counter, Vector)) and "spec_decode" in m.name and m.labels.get("engine") == "0"}


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_mixed_batch_is_token_identical(base, spec):
    """Chunked prefill, preemption, prefix caching, n > 1, logprobs, a stop string."""
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)] * 6
    params += [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2),
               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=["e"])]
    before = _counters(spec)
    want, got = base.run("greedy", prompts, params), spec.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    for w, g in zip(want[:6], got[:6]):
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            assert max(abs(lw[t].logprob - lg[t].logprob) for t in lw) < 1e-5
    stats = spec.llm_engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["prefix_cache_hits"] > 0
    after = _counters(spec)
    drafted = after["vllm:spec_decode_num_draft_tokens"] - before["vllm:spec_decode_num_draft_tokens"]
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    assert accepted > 0
    if spec.method == "draft_model":  # the draft is the target: every greedy draft is accepted
        assert accepted == drafted


def _stream(llm: LLM, prompt, params) -> list[list[int]]:
    """The token ids each step delivered (DELTA outputs): a verify step's accepted run."""
    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine.add_request("stream", {"prompt_token_ids": prompt}, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].token_ids for o in engine.step() if o.outputs[0].token_ids]
    return deltas


def test_stops_inside_an_accepted_run(base, spec):
    """EOS, a stop token id and max_tokens falling inside a run: nothing past them, the same
    tokens as without speculation; the counters move by exactly what the runs accepted."""
    prompt = _prompts()[0]
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = _counters(spec)
    deltas = _stream(spec, prompt, free)
    after = _counters(spec)
    flat = [t for d in deltas for t in d]
    assert flat == base.run("free", [prompt], free)[0].outputs[0].token_ids
    # Every step after the prefill delivered its accepted drafts plus one token.
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    assert accepted == sum(len(d) - 1 for d in deltas[1:])
    per_pos = [a - b for a, b in zip(after["vllm:spec_decode_num_accepted_tokens_per_pos"],
                                     before["vllm:spec_decode_num_accepted_tokens_per_pos"])]
    assert per_pos == [sum(len(d) - 1 > j for d in deltas[1:]) for j in range(spec.k)]
    ends = np.cumsum([len(d) for d in deltas])
    inside = [i for i in range(1, len(flat)) if i + 1 not in ends]  # not the last token of its step
    assert inside, f"no accepted run to stop inside: {deltas}"
    # A stop id at its first occurrence inside a run (n-gram drafts copy earlier tokens, so only a
    # draft model's runs bring new ones; for n-gram the stop id is the token that ends at i).
    new_inside = [i for i in inside if flat[i] not in flat[:i]]
    stop_at = new_inside[0] if new_inside else inside[0]
    assert new_inside or spec.method == "ngram", deltas
    cases = {"max_tokens": SamplingParams(temperature=0.0, max_tokens=inside[0] + 1, ignore_eos=True),
             "stop_id": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                       stop_token_ids=[flat[stop_at]]),
             "eos": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)}
    eos_at = flat.index(spec.get_tokenizer().eos_token_id)
    expect = {"max_tokens": flat[:inside[0] + 1], "stop_id": flat[:flat.index(flat[stop_at]) + 1],
              "eos": flat[:eos_at + 1]}
    for name, params in cases.items():
        want = base.run(f"{name}-{params.max_tokens}-{params.stop_token_ids}", [prompt], params)[0].outputs[0]
        got = [t for d in _stream(spec, prompt, params) for t in d]
        assert got == want.token_ids == expect[name], name
    if spec.method == "draft_model":  # runs of k + 1 (every draft accepted): the EOS falls inside one
        assert eos_at + 1 not in ends


def _chi2_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square test of two histograms with the same total: its p-value."""
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    stat = float(((a - b) ** 2 / (a + b)).sum())
    df = max(len(a) - 1, 1)
    return float(1 - torch.special.gammainc(torch.tensor(df / 2.0, dtype=torch.float64),
                                            torch.tensor(stat / 2.0, dtype=torch.float64)))


def _histograms(outs, positions: int, vocab: int) -> np.ndarray:
    h = np.zeros((positions, vocab), np.int64)
    for o in outs:
        for j, t in enumerate(o.outputs[0].token_ids[:positions]):
            h[j, t] += 1
    return h


def test_temperature_one_seeded_distribution_and_batch_invariance(base, spec, num_seeds=240):
    vocab = int(spec.llm_engine.model_config.hf_config.vocab_size)
    prompts = [_prompts()[i % 3][:6] for i in range(num_seeds)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in range(num_seeds)]
    want = base.run("seeded", prompts, params)
    got = spec.generate(prompts, params, use_tqdm=False)
    hw, hg = _histograms(want, 6, vocab), _histograms(got, 6, vocab)
    for j in range(6):
        assert _chi2_p(hw[j], hg[j]) > 1e-3 / 6, f"position {j}"
    # The test tells different distributions apart: greedy outputs against sampled ones.
    greedy = base.run("greedy_few", prompts[:3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert _chi2_p(_histograms(greedy * (num_seeds // 3), 6, vocab)[3], hw[3]) < 1e-6
    # Seeded: the same tokens alone, in another batch, with or without speculation.
    assert _tokens(got) == _tokens(want)
    alone = [spec.generate([prompts[i]], [params[i]], use_tqdm=False)[0] for i in (0, 7)]
    mixed = spec.generate([prompts[9], prompts[7], prompts[0]], [params[9], params[7], params[0]], use_tqdm=False)
    assert _tokens(alone) == _tokens([got[0], got[7]]) == _tokens([mixed[2], mixed[1]])


def test_no_compiles_and_nothing_leaks(spec):
    runner = spec.llm_engine.get_model_runner()
    assert runner.num_compiles_after_warmup == 0
    assert spec.llm_engine.get_stats()["kv_cache_usage_perc"] == 0.0
    if spec.method == "draft_model":
        assert runner.drafter.num_programs > 0 and runner.num_programs > runner.drafter.num_programs
    c = _counters(spec)
    per_pos = c["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == spec.k and sum(per_pos) == c["vllm:spec_decode_num_accepted_tokens"]
    assert c["vllm:spec_decode_num_accepted_tokens"] <= c["vllm:spec_decode_num_draft_tokens"] \
        <= spec.k * c["vllm:spec_decode_num_drafts"]


def test_refusals_before_loading(model_dir, tmp_path):
    """A draft with another tokenizer and vocabulary is refused naming both models; k beyond the
    step budget is refused naming both numbers (no model is loaded, nothing compiles)."""
    from tests.helpers.tiny_models import make_tiny_llama

    other = make_tiny_llama(tmp_path / "byte_tokenizer_draft")  # the byte tokenizer, vocab 320
    with pytest.raises(ValueError) as err:
        LLM(model=model_dir, speculative_config={"method": "draft_model", "model": other,
                                                 "num_speculative_tokens": 2}, **ENGINE)
    assert other in str(err.value) and model_dir in str(err.value) and "do not share a tokenizer" in str(err.value)
    # skip_tokenizer_init: no tokenizers to compare, the vocabulary sizes still are.
    with pytest.raises(ValueError, match="vocabulary 320.*do not share a tokenizer"):
        LLM(model=model_dir, skip_tokenizer_init=True, speculative_config={
            "method": "draft_model", "model": other, "num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(ValueError, match="num_speculative_tokens=1000000000 must be below max_num_batched_tokens=32"):
        LLM(model=model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 10**9}, **ENGINE)
