"""LoRA under tensor parallel: TP=2 and TP=4 give TP=1's tokens and logprobs (column layers: A whole,
B split; row layers: A split, B whole; KV heads repeated at TP=4), GPT-2's fused c_attn adapter
gives transformers + peft's tokens at TP=2, and nothing compiles after warm-up, adapter loads
included. One subprocess with 8 CPU devices runs every case (tests/helpers/lora_cases.py)."""

from __future__ import annotations

import pytest

from tests.helpers.device_cases import run_cases


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases("tests.helpers.lora_cases", tmp_path_factory.mktemp("lora_tp"))


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_one_device(results, tp):
    one, many = results["llama/1"], results[f"llama/{tp}"]
    assert many["tokens"] == one["tokens"]
    for steps_one, steps_many in zip(one["logprobs"], many["logprobs"]):
        for a, b in zip(steps_one, steps_many):
            assert a.keys() == b.keys()
            assert max(abs(a[k] - b[k]) for k in a) < 1e-4
    # Adapters changed the outputs: the prompts with an adapter differ from the base ones' pattern.
    assert len({tuple(t) for t in one["tokens"]}) == len(one["tokens"])


def test_fused_gpt2_adapter_matches_peft_under_tp(results):
    assert results["gpt2/2"]["tokens"] == results["gpt2/hf"]["tokens"]


def test_no_compiles_after_warmup_with_slot_loads(results):
    for key in ("llama/1", "llama/2", "llama/4", "gpt2/2"):
        assert results[key]["compiles"] == 0, key
        assert results[key]["slot_loads"] >= 2, key  # 3 adapters through 2 slots: loads while serving
