"""fp8 MoE experts (``Fp8MoEMethod``) through ``LLM`` against transformers on the dequantized
weights (tests/helpers/quant_moe.py: a tiny Qwen2-MoE, 7 experts, a shared expert).

- vLLM's per-tensor fp8 checkpoint with static input scales (gate and up each with its own
  scale), compressed-tensors' per-channel fp8, and Mixtral's ``w1/w3/w2`` names: the same
  greedy tokens as transformers, top-4 logprobs within ``TOL`` = 1e-4 (both sides float32 on
  the same dequantized weights: only the rounding order differs), experts held in e4m3.
- online ``--quantization fp8`` on the float checkpoint: the experts quantized per output
  channel at load, 1 byte a weight in the reported weight bytes; within ``TOL`` of
  transformers on the per-channel dequantized weights and within ``FLOAT_TOL`` (0.25 nats;
  measured 0.11: e4m3's 3 mantissa bits on every Linear and expert of a model whose logits
  spread over ~10) of the float model itself, on the tokens both rank in their top 4 (fp8 may
  reorder a near tie there).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers import quant_checkpoints as qc
from tests.helpers import quant_moe as qm

TOL = 1e-4
FLOAT_TOL = 0.25


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("moe_fp8"))


@pytest.mark.parametrize("family,fmt", [("qwen2_moe", "fp8-static"), ("qwen2_moe", "ct-fp8-channel"),
                                        ("mixtral", "fp8")])
def test_fp8_checkpoint_experts_match_transformers(root, family, fmt) -> None:
    base = qm.float_model(root, family)
    qdir, ref = qm.quantized(base, fmt, root)
    got, facts = qm.run_llm(qdir)
    want = qm.hf_greedy(ref)
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert qm.max_logprob_diff(got, want) < TOL
    experts = {k.rsplit(".", 1)[-1]: v for k, v in facts["experts"].items() if ".layers.1." in k}
    assert experts["gate_up_proj"]["dtype"] == experts["down_proj"]["dtype"] == "float8_e4m3fn"
    assert experts["gate_up_scale"]["dtype"] == "float32"
    assert experts["gate_up_scale"]["shape"][1:] == [2, 32]  # per expert, (gate, up), column
    assert facts["compiles"] == 0
    # The quantization is not vacuous: the dequantized experts differ from the float ones.
    name = ("model.layers.1.block_sparse_moe.experts.2.w3.weight" if family == "mixtral"
            else "model.layers.1.mlp.experts.2.up_proj.weight")
    w, deq = (load_file(os.path.join(d, "model.safetensors"))[name] for d in (base, ref))
    assert np.abs(w - deq).max() > 1e-4


def test_online_fp8_quantizes_the_experts_per_channel(root) -> None:
    base = qm.float_model(root)
    got, facts = qm.run_llm(base, quantization="fp8")
    per_channel = qm.hf_greedy(qc.fp8_per_channel_reference(base, os.path.join(root, "online-ref")))
    assert [g["tokens"] for g in got] == [w["tokens"] for w in per_channel]
    assert qm.max_logprob_diff(got, per_channel) < TOL
    float_ref = qm.hf_greedy(base)
    diff = qm.max_logprob_diff(got, float_ref, common_only=True)
    assert 1e-4 < diff < FLOAT_TOL, diff  # close to the float model, yet quantized
    # 1 byte a weight: each stacked expert weight's bytes are its element count.
    weights = {k: v for k, v in facts["experts"].items() if k.endswith(("gate_up_proj", "down_proj"))}
    assert len(weights) == 2  # layer 1 is the sparse one (decoder_sparse_step=2 of 3 layers)
    for v in weights.values():
        assert v["dtype"] == "float8_e4m3fn" and v["bytes"] == int(np.prod(v["shape"]))
    assert facts["weight_bytes"] == facts["held"]
    # Against the float checkpoint (4 bytes a weight): the experts' and Linears' 3 bytes a weight saved.
    float_bytes = sum(a.nbytes for a in load_file(os.path.join(base, "model.safetensors")).values())
    expert_weights = sum(v["bytes"] for v in weights.values())
    assert facts["weight_bytes"] < float_bytes - 3 * expert_weights
