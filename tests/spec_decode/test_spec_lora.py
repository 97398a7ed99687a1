"""Speculative decoding beside LoRA: a verify step's 1 + k tokens take their request's adapter,
and the draft model (the base model itself, without adapters) only proposes, so greedy outputs
equal transformers + peft, base and adapter mixed in one batch; drafts are accepted (all of
them for base requests) and rejected (some, under the adapter)."""

from __future__ import annotations

from jaxlm import LLM, LoRARequest, SamplingParams
from tests.helpers.lora_adapters import PeftReference, make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama

N_OUT = 16


def test_draft_model_with_adapters_matches_peft(tmp_path):
    base = make_tiny_llama(tmp_path / "llama")
    adapter = make_peft_adapter(base, str(tmp_path / "a1"), seed=1, r=4, lora_alpha=8,
                                target_modules=["q_proj", "v_proj", "down_proj"])
    llm = LLM(model=base, enable_lora=True, max_loras=1, max_lora_rank=4, max_num_seqs=4, max_model_len=128,
              max_num_batched_tokens=32, token_buckets=[32], seq_buckets=[16],
              speculative_config={"method": "draft_model", "model": base, "num_speculative_tokens": 3})
    # Each prompt twice, without and with the adapter.
    prompts = [[1] + [3 + (7 * i + j % 5) % 250 for j in range(20)] for i in (0, 0, 1, 1)]
    loras = [None, LoRARequest("a1", 1, adapter), None, LoRARequest("a1", 1, adapter)]
    params = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    ref = PeftReference(base)
    for out, lora, prompt in zip(outs, loras, prompts):
        assert list(out.outputs[0].token_ids) == ref.greedy(lora and adapter, prompt, N_OUT)[0], lora
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the adapter changes the output
    stats = llm.llm_engine.scheduler.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0
