"""MeshExecutor (tensor parallel) on 8 CPU devices: the same outputs as one device.

The cases run once, in a subprocess (tests/helpers/mesh_cases.py) that asks XLA for 8 host
devices before importing jax; the rest of the suite keeps one device. Every case shares one
engine per (model, TP size), prompts chunked (32-token budget) and preempted (8 KV blocks).
"""

from __future__ import annotations

import pytest

from tests.helpers.device_cases import run_cases
from tests.helpers.mesh_cases import CASES


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases("tests.helpers.mesh_cases", tmp_path_factory.mktemp("mesh"))


CASE_KEYS = [(name, tp) for name, (tps, _) in CASES.items() for tp in tps if tp > 1]


@pytest.mark.parametrize("name,tp", CASE_KEYS, ids=[f"{n}-tp{t}" for n, t in CASE_KEYS])
def test_same_tokens_and_logprobs_as_one_device(results, name, tp):
    one, many = results[f"{name}/1"], results[f"{name}/{tp}"]
    # Greedy and seeded sampling (prompt 2) give the same tokens.
    assert many["tokens"] == one["tokens"]
    for steps_one, steps_many in zip(one["logprobs"], many["logprobs"]):
        for a, b in zip(steps_one, steps_many):
            assert a.keys() == b.keys()
            assert max(abs(a[k] - b[k]) for k in a) < 1e-4
    assert many["compiles"] == 0 and one["compiles"] == 0


def test_chunked_prefill_and_preemption_happened(results):
    assert all(results[f"{n}/{t}"]["preemptions"] > 0 for n, t in CASE_KEYS)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_each_device_holds_only_its_shard(results, name):
    w = {tp: results[f"{name}/{tp}"]["weight_bytes"] for tp in (1, 2, 4)}
    kv = {tp: results[f"{name}/{tp}"]["kv_bytes"] for tp in (1, 2, 4)}
    # Weights: everything but the (replicated) norms is split, so TP=t holds about 1/t.
    assert w[2] < 0.52 * w[1] and w[4] < 0.28 * w[1], w
    # KV cache split over the 2 KV heads; at TP=4 each device holds one (replicated) KV head.
    assert kv[2] == kv[1] // 2 and kv[4] == kv[1] // 2, kv
    # GPU memory sizing divides a block's bytes by the devices it is split over.
    assert [results[f"{name}/{tp}"]["kv_shards"] for tp in (1, 2, 4)] == [1, 2, 4]


def test_vocab_tp_does_not_divide_is_padded(results):
    # 322 rows over 4 devices: 81 per device (2 padding rows), never sampled (tokens equal above).
    assert results["llama_vocab322/4"]["tokens"] == results["llama_vocab322/1"]["tokens"]


def test_clear_errors(results):
    errors = results["errors"]
    assert "tensor_parallel_size=16" in errors["too_few_devices"] and "only 8" in errors["too_few_devices"]
    assert "tensor_parallel_size=8" in errors["heads"] and "num_attention_heads=4" in errors["heads"]
