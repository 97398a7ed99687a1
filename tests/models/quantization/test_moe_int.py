"""Integer-weight MoE experts (``PackedIntMoEMethod``: AWQ, GPTQ, compressed-tensors W4A16 and
W8A16) through ``LLM`` against transformers on the dequantized weights (tests/helpers/quant_moe.py:
a tiny Qwen2-MoE, 7 experts of 32, a shared expert, groups of 16).

Tolerance: both sides float32 on the same dequantized weights (the product unpacks and scales
the same values), so the greedy tokens are equal and the top-4 logprobs within ``TOL`` = 1e-4.
The experts stay packed (int32 words, 8 or 4 weights a word); a shape the layout cannot hold is
refused naming the experts' layer.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers import quant_checkpoints as qc
from tests.helpers import quant_moe as qm
from tests.helpers import tiny_models as tm
from tests.models import _parity

TOL = 1e-4
# format -> (weights a packed int32 word, zero points kept)
FORMATS = {"awq": (8, True), "gptq": (8, True), "ct-w4a16": (8, False), "ct-w8a16": (4, False)}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("moe_int"))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int_experts_match_transformers(root, fmt) -> None:
    base = qm.float_model(root)
    qdir, ref = qm.quantized(base, fmt, root)
    got, facts = qm.run_llm(qdir)
    want = qm.hf_greedy(ref)
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert qm.max_logprob_diff(got, want) < TOL
    per_word, zeros = FORMATS[fmt]
    experts = {k.rsplit(".", 1)[-1]: v for k, v in facts["experts"].items()}
    S, H, I = 7, 64, 32
    assert experts["gate_up_qweight"]["dtype"] == experts["down_qweight"]["dtype"] == "int32"
    assert experts["gate_up_qweight"]["shape"] == [S, H // per_word, 2, I]
    assert experts["down_qweight"]["shape"] == [S, I // per_word, H]
    groups = 1 if fmt == "ct-w8a16" else I // qm.GROUP  # W8A16: per channel
    assert experts["down_scales"]["shape"] == [S, groups, H]
    assert ("down_qzeros" in experts) == zeros
    assert facts["compiles"] == 0 and facts["weight_bytes"] == facts["held"]
    # The quantization is not vacuous: the dequantized experts differ from the float ones.
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    w, deq = (load_file(os.path.join(d, "model.safetensors"))[name] for d in (base, ref))
    assert np.abs(w - deq).max() > 1e-3


def test_expert_shapes_the_packing_cannot_hold_are_refused_naming_the_layer(root) -> None:
    # Experts of 36: 4-bit words hold 8 rows, and 36 output columns of gate/up are no whole words.
    path = tm.make_tiny_model("qwen2_moe", os.path.join(root, "odd"), moe_intermediate_size=36)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc.quantization_config("ct-w4a16", qm.GROUP)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: CompressedTensorsWNA16Method: 4-bit "
                                         r"packing needs in and out features divisible by 8, got 64 x 36"):
        _parity.build_model(path)
