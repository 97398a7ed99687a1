"""LoRA through the offline API: the same greedy tokens as transformers + peft (logprobs within
1e-4), base and adapters mixed in one generate, more adapters than slots, chunked prefill and
preemption, no prefix-cache leak between adapters, no compile after warm-up.

One engine for the module: 2 slots of rank 8 and 3 adapters in host memory for 4 adapters, a
32-token step budget (prompts of 40+ tokens are chunked) and 10 KV blocks of 16 tokens for 4
sequences (requests are preempted).
"""

from __future__ import annotations

import pytest

from jaxlm import LLM, LoRARequest, SamplingParams
from tests.helpers.lora_adapters import ALL_MODULES, PeftReference, make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama

TOL = 1e-4
N_OUT = 10
GREEDY = SamplingParams(max_tokens=N_OUT, temperature=0.0, logprobs=1, ignore_eos=True)
# Ranks, alphas, rsLoRA, per-module rank/alpha patterns and module subsets all differ.
ADAPTERS = {
    "a1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "a2": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
    "a3": dict(r=2, lora_alpha=16, target_modules=ALL_MODULES, rank_pattern={"q_proj": 6},
               alpha_pattern={"down_proj": 3}),
    "a4": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def _prompt(i: int, n: int) -> list[int]:
    return [1] + [3 + (11 * i + 5 * j) % 250 for j in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(root / "llama")
    paths = {name: make_peft_adapter(base, str(root / name), seed=i + 1, **kw)
             for i, (name, kw) in enumerate(ADAPTERS.items())}
    llm = LLM(model=base, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3, max_num_seqs=4,
              max_model_len=128, max_num_batched_tokens=32, token_buckets=[16, 32], seq_buckets=[4],
              num_gpu_blocks_override=10)
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}
    return llm, loras, paths, PeftReference(base), root


def _check(out, ref, adapter, prompt):
    tokens, lps = ref.greedy(adapter, prompt, N_OUT)
    got = list(out.outputs[0].token_ids)
    assert got == tokens, adapter
    got_lps = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(got)]
    assert max(abs(a - b) for a, b in zip(got_lps, lps)) < TOL, adapter


def test_mixed_adapters_match_peft(setup):
    llm, loras, paths, ref, _ = setup
    names = [None, "a1", "a2", "a3", "a4", "a1", None, "a3"]
    prompts = [_prompt(i, n) for i, n in enumerate((45, 9, 40, 13, 50, 21, 7, 33))]
    runner = llm.llm_engine.get_model_runner()
    preemptions = llm.llm_engine.scheduler.num_preemptions
    per_step, token_slots = [], runner.lora.token_slots

    def counting(*args):  # distinct slots each step uses
        slots, failed = token_slots(*args)
        per_step.append(len(set(slots[slots >= 0].tolist())))
        return slots, failed

    runner.lora.token_slots = counting
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                            lora_request=[loras[n] if n else None for n in names], use_tqdm=False)
    finally:
        del runner.lora.token_slots
    for out, name, prompt in zip(outs, names, prompts):
        _check(out, ref, paths.get(name), prompt)
    assert llm.llm_engine.scheduler.num_preemptions > preemptions  # the tiny cache preempted some
    assert runner.lora.num_slot_loads >= 4  # 4 adapters through 2 slots (max_loras=2) ...
    assert len(runner.lora._cpu) == 3  # ... and 3 kept in host memory (max_cpu_loras=3)
    assert max(per_step) == 2  # never more adapters in one step than slots
    # Each adapter changes the output (otherwise the comparisons above would prove little).
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:5]}) == 5


def test_same_prompt_two_adapters_no_prefix_cache_leak(setup):
    llm, loras, paths, ref, _ = setup
    prompt = _prompt(99, 40)  # two full 16-token blocks
    cached = {}
    for run in ("a1", "a2", "a1_again", "base", "base_again"):
        name = run.removesuffix("_again")
        lora = loras.get(name)
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=lora, use_tqdm=False)[0]
        _check(out, ref, paths.get(name), prompt)
        cached[run] = out.num_cached_tokens
    assert cached == {"a1": 0, "a2": 0, "a1_again": 32, "base": 0, "base_again": 32}


def test_prompt_logprobs_with_adapters(setup):
    # The prompt-logprobs program carries the token slots too: a chunked prompt under each adapter.
    llm, loras, paths, ref, _ = setup
    prompt = _prompt(7, 37)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, params, lora_request=[None, loras["a2"], loras["a3"]],
                        use_tqdm=False)
    for out, name in zip(outs, (None, "a2", "a3")):
        got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        want = ref.prompt_logprobs(paths.get(name), prompt)
        assert max(abs(a - b) for a, b in zip(got, want)) < TOL, name


def test_chat_takes_lora_request(setup):
    llm, loras, _, _, _ = setup
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "hello there, adapter"}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    chat = llm.chat(messages, params, chat_template=template, lora_request=loras["a2"], use_tqdm=False)[0]
    prompt = {"prompt_token_ids": chat.prompt_token_ids}
    with_lora = llm.generate(prompt, params, lora_request=loras["a2"], use_tqdm=False)[0]
    base = llm.generate(prompt, params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == with_lora.outputs[0].token_ids != base.outputs[0].token_ids


def test_bad_adapters_fail_alone(setup, tmp_path):
    llm, loras, paths, _, root = setup
    big = make_peft_adapter(str(root / "llama"), str(tmp_path / "big"), seed=9, r=16, target_modules=["q_proj"])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="LoRA rank 16 of .*q_proj is greater than max_lora_rank 8"):
        llm.generate([[1, 5, 6], [1, 7, 8]], params, lora_request=[None, LoRARequest("big", 50, big)])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([1, 5, 6], params, lora_request=LoRARequest("none", 51, str(tmp_path)))
    with pytest.raises(ValueError, match="2 lora requests for 1 prompts"):
        llm.generate([1, 5, 6], params, lora_request=[None, None])
    assert not llm.llm_engine.has_unfinished_requests()  # nothing of the failed calls was queued
    out = llm.generate([1, 5, 6], params, lora_request=loras["a1"], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0


def test_no_compiles_and_no_extra_programs(setup):
    llm, _, _, _, _ = setup
    runner = llm.llm_engine.get_model_runner()
    assert runner.num_compiles_after_warmup == 0  # adapter loads into slots included
    # The same program count as without LoRA: the bucket lists' sum, nothing per adapter.
    assert runner.num_programs == (len(runner.token_buckets) + len(runner.decode_buckets)
                                   + len(runner.prompt_logprobs_buckets) + 6 * len(runner.seq_buckets))
