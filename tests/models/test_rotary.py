"""Rope parameters are read from both transformers layouts and match HF's inverse frequencies."""

from __future__ import annotations

import types

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxlm.models.rotary import RotaryEmbedding, _inv_freq, get_rope_parameters

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)


def _ours(cfg, head_dim=16) -> np.ndarray:
    r = RotaryEmbedding.from_config(cfg, head_dim)
    return _inv_freq(r.head_dim, r.theta, r.rope_type, r.fields)


@pytest.mark.parametrize(
    "scaling",
    [None, dict(rope_type="linear", factor=2.0), dict(rope_type="llama3", **LLAMA3)],
)
def test_inv_freq_matches_transformers(scaling) -> None:
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=scaling)
    cfg.rope_parameters["rope_theta"] = 5000.0
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        ref = 1.0 / (5000.0 ** (np.arange(0, 16, 2) / 16))
    else:
        ref = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")[0].numpy()
    got = _ours(cfg)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    if rope_type == "llama3":
        # The scaling must actually change the low frequencies.
        assert not np.allclose(got, 1.0 / (5000.0 ** (np.arange(0, 16, 2) / 16)))


def test_transformers4_layout_rope_theta_and_rope_scaling_attributes() -> None:
    # 4.x: top-level rope_theta, rope_scaling with the old "type" key, no rope_parameters.
    cfg = types.SimpleNamespace(rope_theta=500000.0, rope_scaling=dict(type="llama3", **LLAMA3))
    theta, rope_type, fields = get_rope_parameters(cfg)
    assert (theta, rope_type) == (500000.0, "llama3")
    assert dict(fields)["factor"] == 8.0
    assert get_rope_parameters(types.SimpleNamespace(rope_theta=1e6, rope_scaling=None))[:2] == (1e6, "default")


def test_transformers5_layout_rope_parameters_only() -> None:
    cfg = types.SimpleNamespace(rope_parameters=dict(rope_type="default", rope_theta=1234.0))
    assert get_rope_parameters(cfg)[:2] == (1234.0, "default")
    assert get_rope_parameters(types.SimpleNamespace())[:2] == (10000.0, "default")


def test_unsupported_rope_type_is_refused_at_construction() -> None:
    cfg = types.SimpleNamespace(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0))
    with pytest.raises(ValueError, match="yarn.*supported: default, linear, llama3"):
        RotaryEmbedding.from_config(cfg, 16)


def test_rotary_is_hashable_static_data() -> None:
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=dict(rope_type="llama3", **LLAMA3))
    a, b = RotaryEmbedding.from_config(cfg, 16), RotaryEmbedding.from_config(cfg, 16)
    assert a == b and hash(a) == hash(b)
