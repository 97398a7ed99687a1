"""Each checkpoint format against transformers on the float model of its dequantized weights.

The tests quantize a tiny Llama (hidden 128, so a group of 128 divides every input dimension)
themselves (tests/helpers/quant_checkpoints.py), load it as a quantized model (the weights stay
in their bytes: e4m3, packed int32), prefill several prompts, decode greedily over the paged
cache, and compare with transformers running the dequantized weights in float32.

Tolerance: the same weights in float32 on both sides; only the order of rounding differs (the
scale applied to the product instead of to each weight), so the f32 parity bound holds
(``TOL`` = 1e-4 on logits of magnitude ~1-10) and the greedy tokens are equal.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file

from jaxlm.models.quantization import get_quantization_config
from tests.helpers import quant_checkpoints as qc
from tests.helpers import tiny_models as tm
from tests.models import _parity

PROMPTS = [[5, 9, 3, 7, 11, 13, 2 + 40], [100, 101, 17, 4], [8] * 9]
TOL = 2e-4
# The dtype each format keeps its weight in on the device.
STORED = {"fp8": ("weight", jnp.float8_e4m3fn), "ct-fp8-channel": ("weight", jnp.float8_e4m3fn),
          "ct-w4a16": ("qweight", jnp.int32), "ct-w8a16": ("qweight", jnp.int32),
          "awq": ("qweight", jnp.int32), "gptq": ("qweight", jnp.int32)}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> str:
    return tm.make_tiny_llama(tmp_path_factory.mktemp("float") / "llama", hidden_size=128, intermediate_size=256)


@pytest.mark.parametrize("fmt", qc.FORMATS)
def test_format_matches_transformers_on_dequantized_weights(float_dir, tmp_path, fmt, record_property) -> None:
    qdir, ref = qc.write_quantized(float_dir, fmt, str(tmp_path / "q"), str(tmp_path / "ref"))
    res = _parity.run_parity(qdir, PROMPTS, steps=8, ref_path=ref)
    _parity.assert_parity(res, fmt, record_property, tol=TOL)
    model, _, _ = _parity.build_model(qdir)
    q_proj = model.model.layers[0].self_attn.q_proj
    name, dtype = STORED[fmt]
    assert getattr(q_proj, name).get_value().dtype == dtype
    # The dequantized weights differ from the float ones they came from (the test is not vacuous).
    w, deq = (load_file(os.path.join(d, "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
              for d in (float_dir, ref))
    assert np.abs(w - deq).max() > 1e-3


def test_online_fp8_quantizes_per_channel_at_load(float_dir, tmp_path, record_property) -> None:
    ref = qc.fp8_per_channel_reference(float_dir, str(tmp_path / "ref"))
    res = _parity.run_parity(float_dir, PROMPTS, steps=8, ref_path=ref, quantization="fp8")
    _parity.assert_parity(res, "online fp8", record_property, tol=TOL)
    model, _, _ = _parity.build_model(float_dir, quantization="fp8")
    down = model.model.layers[1].mlp.down_proj
    assert down.weight.get_value().dtype == jnp.float8_e4m3fn
    assert down.weight_scale.get_value().shape == (down.out_features,)


def _config_with(quant: dict):
    config = transformers.LlamaConfig()
    config.quantization_config = quant
    return config


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act=true"),
    ({"quant_method": "bitsandbytes"}, r"'bitsandbytes' is not supported.*awq, compressed-tensors, fp8, gguf, gptq"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "awq", "w_bit": 3, "q_group_size": 128}, "3-bit"),
])
def test_bad_quantization_configs_are_refused_naming_them(quant, match) -> None:
    with pytest.raises(ValueError, match=match):
        get_quantization_config(None, _config_with(quant))


def test_group_size_that_does_not_divide_the_input_is_refused(float_dir, tmp_path) -> None:
    qdir, _ = qc.write_quantized(float_dir, "gptq", str(tmp_path / "q"), str(tmp_path / "ref"))
    with open(os.path.join(qdir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["group_size"] = 96  # 128 % 96 != 0
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.\S+: GPTQLinearMethod: group_size 96 does not "
                                         r"divide the layer's input dimension (128|256)"):
        _parity.build_model(qdir)


def test_quantization_flag_must_match_the_checkpoint(float_dir, tmp_path) -> None:
    qdir, _ = qc.write_quantized(float_dir, "awq", str(tmp_path / "q"), str(tmp_path / "ref"))
    with pytest.raises(ValueError, match="does not match the checkpoint's quantization method 'awq'"):
        _parity.build_model(qdir, quantization="gptq")
