"""Quantized MoE experts under expert and tensor parallel (8 CPU devices,
tests/helpers/quant_moe_mesh_cases.py): the greedy tokens of transformers on the dequantized
weights (top-4 logprobs within 1e-4), the stacked quantized Params split like the float experts
(by expert under EP; gate/up columns and their scales, down's input rows and groups under TP;
down's per-column fp8 scale whole), per-channel int8 Linears under TP, and a down projection
whose groups do not split refused naming the layer (experts) or the tensor (a Linear)."""

from __future__ import annotations

import pytest

from tests.helpers import quant_moe as qm
from tests.helpers.device_cases import run_cases
from tests.helpers.quant_moe_mesh_cases import CASES

S, H, I = 7, 64, 32


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases("tests.helpers.quant_moe_mesh_cases", tmp_path_factory.mktemp("quant_moe_mesh"), timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_same_tokens_as_transformers(results, name):
    case = results[name]
    assert [g["tokens"] for g in case["got"]] == [w["tokens"] for w in case["want"]]
    assert qm.max_logprob_diff(case["got"], case["want"]) < 1e-4
    assert case["compiles"] == 0


def _shards(case: dict) -> dict[str, list[int]]:
    return {k.rsplit(".", 1)[-1]: v["shard"] for k, v in case["experts"].items()}


def test_expert_parallel_splits_the_fp8_experts_by_expert(results):
    shards = _shards(results["fp8-static/ep2"])
    slots = 8  # 7 experts on 2 devices: 4 slots each
    assert shards["gate_up_proj"] == [slots // 2, H, 2, I] and shards["down_proj"] == [slots // 2, I, H]
    assert shards["gate_up_scale"] == [slots // 2, 2, I] and shards["down_scale"] == [slots // 2, H]


def test_tensor_parallel_splits_the_intermediate_size_with_its_scales(results):
    fp8 = _shards(results["online/tp2"])
    assert fp8["gate_up_proj"] == [S, H, 2, I // 2] and fp8["gate_up_scale"] == [S, 2, I // 2]
    assert fp8["down_proj"] == [S, I // 2, H] and fp8["down_scale"] == [S, H]  # down's columns: whole
    awq = _shards(results["awq/tp2"])
    assert awq["gate_up_qweight"] == [S, H // 8, 2, I // 2] and awq["gate_up_scales"] == [S, H // 16, 2, I // 2]
    assert awq["down_qweight"] == [S, I // 8 // 2, H]
    assert awq["down_scales"] == awq["down_qzeros"] == [S, I // 16 // 2, H]  # whole groups per device


def test_groups_that_do_not_split_are_refused_naming_the_layer(results):
    error = results["group_error"]
    assert "model.layers.1.mlp.experts" in error and "tensor_parallel_size=4" in error, error
    assert "--enable-expert-parallel" in error


def test_a_linear_whose_groups_do_not_split_is_refused_naming_the_tensor(results):
    error = results["linear_group_error"]
    assert ".mlp.shared_expert.down_proj." in error and "over 2 devices" in error, error
    assert "tensor_parallel_size" in error, error
