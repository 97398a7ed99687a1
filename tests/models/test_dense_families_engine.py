"""The dense families under the engine, against transformers: greedy tokens equal, logprobs
within 1e-4, with chunked prefill, preemption and prefix caching, at TP=2 on 8 CPU devices.

The engine runs once, in a subprocess (tests/helpers/dense_family_cases.py); the transformers
reference runs here, teacher-forced: one forward over prompt + our tokens gives the logits
transformers' own greedy loop would see at each step if its history equals ours, so our tokens
are its greedy tokens iff each is the argmax there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.dense_family_cases import CASES, PROMPTS
from tests.helpers.device_cases import run_cases
from tests.helpers.tiny_models import load_hf_model

KEYS = [(family, tp) for family, (tps, _) in CASES.items() for tp in tps]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases("tests.helpers.dense_family_cases", tmp_path_factory.mktemp("dense"))


@pytest.mark.parametrize("family,tp", KEYS, ids=[f"{f}-tp{t}" for f, t in KEYS])
def test_engine_matches_transformers(results, family, tp):
    res = results[f"{family}/{tp}"]
    hf = load_hf_model(results[f"{family}/path"])
    assert res["compiles"] == 0
    # Both passes (the second reading whole prompts from the prefix cache) give the same tokens.
    assert res["passes"][0]["tokens"] == res["passes"][1]["tokens"]
    for run in res["passes"]:
        for prompt, tokens, logprobs in zip(PROMPTS, run["tokens"], run["logprobs"]):
            assert len(tokens) == 12
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
            ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1].numpy()
            assert tokens == ref.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens diverged"
            diff = np.abs(np.asarray(logprobs) - ref[np.arange(len(tokens)), tokens]).max()
            assert diff < 1e-4, diff


def test_mechanisms_happened(results):
    for family, tp in KEYS:
        res = results[f"{family}/{tp}"]
        assert res["preemptions"] > 0, family
        # Every prompt of the second pass hits at least its shared 16-token block (more: whole prompts).
        assert res["prefix_hits"] >= 16 * 2 * len(PROMPTS), family
        assert res["kv_usage"] == 0.0, family  # no block leaks
