"""A draft model under a tensor-parallel target: at draft_tensor_parallel_size 1 (its own
one-device mesh) and 2 (the target's), the target's greedy tokens (transformers'), every draft
accepted (the draft is the target), no compile after warm-up."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers.device_cases import run_cases


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases("tests.helpers.spec_mesh_cases", tmp_path_factory.mktemp("spec_tp"))


def test_draft_tp_1_and_2_under_tp_2(results):
    model = transformers.AutoModelForCausalLM.from_pretrained(results["path"], dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in results["prompts"]:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=16, do_sample=False, pad_token_id=0)
            want.append(ids[0, len(p):].tolist())
    for tp in (1, 2):
        r = results[f"draft_tp{tp}"]
        # transformers stops at the tokenizer's EOS; the engine ignores it (ignore_eos).
        assert [t[:len(w)] for t, w in zip(r["tokens"], want)] == want, tp
        assert r["compiles"] == 0 and r["accepted"] == r["drafted"] > 0, tp
    assert results["draft_tp1"]["draft_devices"] == [0]
    assert results["draft_tp2"]["draft_devices"] == [0, 1]
