"""Pipeline parallel (MeshExecutor + PipelineModelRunner) on 8 CPU devices: the same outputs as one device.

The cases run once, in a subprocess (tests/helpers/pp_cases.py, 8 host devices), with the
engine settings of the tensor-parallel cases: prompts chunked (32-token budget) and preempted
(8 KV blocks), one engine per (model, TP x PP).
"""

from __future__ import annotations

import pytest

from tests.helpers.device_cases import run_cases
from tests.helpers.pp_cases import CASES


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases("tests.helpers.pp_cases", tmp_path_factory.mktemp("pp"))


CASE_KEYS = [(name, tp, pp) for name, (_, sizes) in CASES.items() for tp, pp in sizes if pp > 1]
IDS = [f"{n}-tp{tp}-pp{pp}" for n, tp, pp in CASE_KEYS]


@pytest.mark.parametrize("name,tp,pp", CASE_KEYS, ids=IDS)
def test_same_tokens_and_logprobs_as_one_device(results, name, tp, pp):
    one, many = results[f"{name}/1x1"], results[f"{name}/{tp}x{pp}"]
    assert many["tokens"] == one["tokens"]  # greedy, and seeded sampling (prompt 2)
    for steps_one, steps_many in zip(one["logprobs"], many["logprobs"]):
        for a, b in zip(steps_one, steps_many):
            assert a.keys() == b.keys()
            assert max(abs(a[k] - b[k]) for k in a) < 1e-4
    plp_one, plp_many = one["prompt_logprobs"], many["prompt_logprobs"]
    assert plp_many[0] is None and len(plp_many) == len(plp_one) > 1
    for a, b in zip(plp_one[1:], plp_many[1:]):
        assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 1e-4
    assert many["compiles"] == 0 and one["compiles"] == 0
    # Under chunked prefill and preemption.
    assert many["preemptions"] > 0


@pytest.mark.parametrize("name,tp,pp", CASE_KEYS, ids=IDS)
def test_each_stage_holds_only_its_layers(results, name, tp, pp):
    stages = results[f"{name}/{tp}x{pp}"]["stages"]
    num_layers = CASES[name][0]["num_hidden_layers"]
    # Contiguous ranges; an uneven split gives the first stages one more layer.
    sizes = [len(st["layers"]) for st in stages]
    assert sum(sizes) == num_layers and sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert [i for st in stages for i in st["layers"]] == list(range(num_layers))
    for s, st in enumerate(stages):
        assert st["devices"] == st["mesh_devices"] == list(range(s * tp, (s + 1) * tp))
    # Each device holds its stage's share of the KV cache, and of the weights its layers' share
    # plus at most the rest (embedding, LM head, final norm; ~5% slack: TP-replicated norms).
    one = results[f"{name}/1x1"]
    layer_bytes, other_bytes = one["layer_weight_bytes"], one["weight_bytes"] - one["layer_weight_bytes"]
    for st, n in zip(stages, sizes):
        assert st["kv_bytes"] == one["kv_bytes"] * n // num_layers // tp
        share = layer_bytes * n / num_layers / tp
        assert share <= st["weight_bytes"] <= (share + other_bytes / tp) * 1.05, (st, share, other_bytes)
    # GPU memory sizing divides a block's bytes by what the busiest device holds of it (rounded down).
    assert results[f"{name}/{tp}x{pp}"]["kv_shards"] == tp * num_layers // max(sizes)


@pytest.mark.parametrize("name,tp,pp", CASE_KEYS, ids=IDS)
def test_micro_batches_overlap_stages(results, name, tp, pp):
    schedules = results[f"{name}/{tp}x{pp}"]["schedules"]
    # A step with at least pp requests runs pp micro-batches: each stage runs once per
    # micro-batch, in pipeline order (clock t: stage s on micro-batch t - s).
    full = [s for s in schedules if len(s) == pp * pp]
    assert full, schedules
    expected = [[s, t - s] for t in range(2 * pp - 1) for s in range(pp) if 0 <= t - s < pp]
    assert all(s == expected for s in full)
    for step in full:
        assert all(sum(1 for st, _ in step if st == s) == pp for s in range(pp))
    if pp == 2:  # stage 0 runs micro-batch 1 before stage 1 runs micro-batch 0 finishes the first
        assert full[0] == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_orbax_checkpoint_loads_onto_the_stages(results):
    layout = results["orbax_layout"]  # llama, 4 layers, PP=2: layers 0-1 on device 0, 2-3 on device 1
    for name, devices in layout.items():
        if ".layers." in name:
            assert devices == [int(name.split(".layers.")[1].split(".")[0]) // 2], (name, devices)
    assert layout["model.embed_tokens.weight"] == [0] and layout["lm_head.weight"] == [1]


def test_program_count_is_stages_times_body_buckets_plus_samplers(results):
    one, two, four = (results[f"llama/{k}"]["programs"] for k in ("1x1", "1x2", "1x4"))
    samplers = 6  # one sequence bucket x 6 variants
    assert (two - samplers) == 2 * (one - samplers) and (four - samplers) == 4 * (one - samplers)


def test_clear_errors(results):
    errors = results["errors"]
    too_few = errors["too_few_devices"]
    assert "tensor_parallel_size=2" in too_few and "pipeline_parallel_size=8" in too_few and "only 8" in too_few
    assert "pipeline_parallel_size=8" in errors["too_few_layers"] and "num_hidden_layers=4" in errors["too_few_layers"]
