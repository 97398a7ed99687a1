"""Quantized models under tensor parallel (8 CPU devices, tests/helpers/quant_mesh_cases.py): the
same tokens as one device (logprobs within 1e-4), per-channel scales split with their weights'
output columns (column-parallel) and whole beside row-parallel ones, each device holding its
shard, no compile after warm-up; packed int weights refuse repeated KV heads naming why."""

from __future__ import annotations

import pytest

from tests.helpers.device_cases import run_cases
from tests.helpers.quant_mesh_cases import CASES


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases("tests.helpers.quant_mesh_cases", tmp_path_factory.mktemp("quant_mesh"), timeout=900)


CASE_KEYS = [(name, tp) for name, (_, _, tps) in CASES.items() for tp in tps if tp > 1]


@pytest.mark.parametrize("name,tp", CASE_KEYS, ids=[f"{n}-tp{t}" for n, t in CASE_KEYS])
def test_same_tokens_and_logprobs_as_one_device(results, name, tp):
    one, many = results[f"{name}/1"], results[f"{name}/{tp}"]
    assert many["tokens"] == one["tokens"]
    for steps_one, steps_many in zip(one["logprobs"], many["logprobs"]):
        for a, b in zip(steps_one, steps_many):
            assert a.keys() == b.keys()
            assert max(abs(a[k] - b[k]) for k in a) < 1e-4
    assert many["compiles"] == 0 and one["compiles"] == 0
    assert many["preemptions"] > 0  # chunked and preempted as mesh_cases arranges


@pytest.mark.parametrize("name,tp", CASE_KEYS, ids=[f"{n}-tp{t}" for n, t in CASE_KEYS])
def test_scales_are_sharded_with_their_weights(results, name, tp):
    one, many = results[f"{name}/1"], results[f"{name}/{tp}"]
    # q_proj (column-parallel): its scales' output columns split like the weight's.
    assert many["q_scale"][-1] * tp == one["q_scale"][-1]
    # o_proj (row-parallel): per-channel scales whole; group scales split by input groups.
    if name.startswith("ct-w4a16"):
        assert many["o_scale"][0] * tp == one["o_scale"][0]
    else:
        assert many["o_scale"] == one["o_scale"]
    assert many["weight_bytes"] < one["weight_bytes"]


def test_packed_int_weights_refuse_repeated_kv_heads(results):
    assert "k_proj" in results["kv_repeat_error"]
    assert "repeats the KV projections" in results["kv_repeat_error"]
