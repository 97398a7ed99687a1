"""GGUF MoE experts in blocks under expert and tensor parallel (8 CPU devices,
tests/helpers/gguf_moe_mesh_cases.py): transformers' greedy tokens on the dequantized weights
(top-4 logprobs within 0.05 nats on the tokens both rank there: the C++ kernel's int8
activations), the blocks split by expert slot (EP) or gate/up by rows and down by input columns
in whole blocks and kernel row groups (TP), and a split into half blocks refused naming the layer."""

from __future__ import annotations

import pytest

from tests.helpers import quant_moe as qm
from tests.helpers.device_cases import run_cases
from tests.helpers.gguf_moe_mesh_cases import CASES

S, H, I = 7, 64, 64


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from jaxlm.attention.backends import cpu_kernels_unavailable

    if cpu_kernels_unavailable():
        pytest.skip("the C++ kernels cannot be built here")
    return run_cases("tests.helpers.gguf_moe_mesh_cases", tmp_path_factory.mktemp("gguf_moe_mesh"), timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_same_tokens_as_transformers(results, name):
    case = results[name]
    assert [g["tokens"] for g in case["got"]] == [w["tokens"] for w in case["want"]]
    assert qm.max_logprob_diff(case["got"], case["want"], common_only=True) < 0.05
    assert case["compiles"] == 0


def _shards(case: dict) -> dict[str, list[int]]:
    return {k.rsplit(".", 1)[-1]: v["shard"] for k, v in case["experts"].items()}


def test_expert_parallel_splits_by_slot(results):
    shards = _shards(results["ep2"])
    # 7 experts on 2 devices: 4 slots each; Q8_0 rows interleaved by 16 (64 rows: 4 groups).
    assert shards["gate_qweight"] == [4, I // 16, 16 * 34 * H // 32]
    assert shards["up_qweight"] == [4, I // 16, 16 * 20 * H // 32]  # Q4_1
    assert shards["down_qweight"] == [4, H // 16, 16 * 34 * I // 32]


def test_tensor_parallel_splits_rows_and_input_blocks(results):
    shards = _shards(results["tp2"])
    assert shards["gate_qweight"] == [S, I // 16 // 2, 16 * 34 * H // 32]  # 2 of the 4 row groups
    assert shards["down_qweight"] == [S, H // 16, 16 * 34 * I // 32 // 2]  # 1 of the 2 input blocks


def test_a_split_into_half_blocks_is_refused_naming_the_layer(results):
    error = results["split_error"]
    assert "model.layers.1.mlp.experts" in error and "tensor_parallel_size=2" in error, error
    assert "--enable-expert-parallel" in error
