"""Expert parallelism on 8 CPU devices: EP=2, EP=4 and TP=2 without EP give one device's tokens;
so does EP=4 over 10 and 6 experts, spread as vLLM's determine_expert_map (3, 3, 2, 2; 2, 2, 1, 1).

The cases run once, in a subprocess (tests/helpers/moe_cases.py) that asks XLA for 8 host
devices before importing jax; one engine per case, prompts chunked and preempted.
"""

from __future__ import annotations

import pytest

from tests.helpers.device_cases import run_cases


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases("tests.helpers.moe_cases", tmp_path_factory.mktemp("moe"), timeout=1200)


@pytest.mark.parametrize("case", ["ep2", "ep4", "tp2"])
def test_same_tokens_and_logprobs_as_one_device(results, case):
    one, many = results["tp1"], results[case]
    assert many["tokens"] == one["tokens"]  # greedy and seeded sampling
    for steps_one, steps_many in zip(one["logprobs"], many["logprobs"]):
        for a, b in zip(steps_one, steps_many):
            assert a.keys() == b.keys()
            assert max(abs(a[k] - b[k]) for k in a) < 1e-4
    assert many["compiles"] == 0 and one["compiles"] == 0
    assert many["preemptions"] > 0


def test_each_device_holds_its_experts(results):
    e = {k: results[k]["expert_bytes"] for k in ("tp1", "ep2", "ep4", "tp2")}
    # Whole experts (EP) or a slice of each (TP): either way 1/tp of the expert weights.
    assert e["ep2"] == e["tp1"] // 2 and e["ep4"] == e["tp1"] // 4 and e["tp2"] == e["tp1"] // 2, e
    print(f"\nexpert bytes on device 0: {e}; all weights: "
          f"{ {k: results[k]['weight_bytes'] for k in e} }")


@pytest.mark.parametrize("experts, most", [(10, 3), (6, 2)])
def test_experts_that_do_not_divide_give_one_devices_greedy_tokens(results, experts, most):
    """EP=4 over 10 (3, 3, 2, 2 per device) and 6 experts (2, 2, 1, 1), against transformers on
    the same weights: a misplaced expert or a token routed to the wrong slot changes the tokens."""
    case = results[f"e{experts}"]
    assert case["tokens"] == case["hf_tokens"]
    assert case["compiles"] == 0 and case["preemptions"] > 0
    # Device 0 holds ceil(E / 4) whole experts: `most` of the E experts' bytes.
    per_expert, rem = divmod(results["tp1"]["expert_bytes"], 8)  # the 8-expert model: same expert shapes
    assert rem == 0 and case["expert_bytes"] == most * per_expert, (case["expert_bytes"], per_expert)


def test_sizes_that_do_not_divide_are_refused(results):
    errors = results["errors"]
    assert "tensor_parallel_size=4" in errors["intermediate"] and "30" in errors["intermediate"], errors
    assert "tensor_parallel_size=8" in errors["heads"] and "num_attention_heads=4" in errors["heads"], errors
