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


def _phi3_config(**kw) -> transformers.Phi3Config:
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                original_max_position_embeddings=16, partial_rotary_factor=0.5, pad_token_id=0,
                rope_scaling=dict(type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0], long_factor=[1.0, 3.0, 6.0, 12.0]))
    base.update(kw)
    return transformers.Phi3Config(**base)


@pytest.mark.parametrize("n_pos,max_model_len,factors", [(40, 256, "long"), (10, 16, "short"), (10, None, "long")])
def test_partial_rotary_longrope_matches_transformers(n_pos, max_model_len, factors) -> None:
    """Rope on the first half of each head only; longrope's factors chosen by max_model_len (a static
    choice) equal transformers' per-call choice whenever the call's positions agree with it."""
    import jax.numpy as jnp
    import torch
    from transformers.models.phi3 import modeling_phi3

    cfg = _phi3_config()
    rope = RotaryEmbedding.from_config(cfg, 16, max_model_len=max_model_len)
    assert rope.dim == 8 and rope.rope_type == "longrope"
    assert dict(rope.fields)["ext_factors"] == tuple(cfg.rope_parameters[f"{factors}_factor"])
    assert rope.mscale == pytest.approx(np.sqrt(1 + np.log(256 / 16) / np.log(16)))
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((n_pos, 4, 16), np.float32), rng.standard_normal((n_pos, 2, 16), np.float32)
    got_q, got_k = rope(jnp.arange(n_pos), jnp.asarray(q), jnp.asarray(k))
    # transformers picks the factors per call, by its longest position: for few positions and
    # our long choice, ask it with 17 positions (> original 16) and keep the first ones.
    hf_rope = modeling_phi3.Phi3RotaryEmbedding(cfg)
    n_call = 17 if factors == "long" and n_pos <= 16 else n_pos
    cos, sin = hf_rope(torch.zeros(1), torch.arange(n_call)[None])
    cos, sin = cos[:, :n_pos], sin[:, :n_pos]
    ref_q, ref_k = modeling_phi3.apply_rotary_pos_emb(torch.tensor(q)[None].transpose(1, 2),
                                                      torch.tensor(k)[None].transpose(1, 2), cos, sin)
    np.testing.assert_allclose(np.asarray(got_q), ref_q[0].transpose(0, 1).numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_k), ref_k[0].transpose(0, 1).numpy(), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_q)[..., 8:], q[..., 8:])  # the rest passes through


def test_longrope_factor_length_is_checked() -> None:
    cfg = types.SimpleNamespace(max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=1e4, original_max_position_embeddings=16,
        short_factor=[1.0] * 3, long_factor=[1.0] * 4))
    with pytest.raises(ValueError, match="short_factor with 4 numbers"):
        RotaryEmbedding.from_config(cfg, 8)


def test_per_layer_type_rope_parameters() -> None:
    cfg = types.SimpleNamespace(rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                                                 "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6)})
    assert get_rope_parameters(cfg, "sliding_attention") == (10.0, "default", ())
    assert get_rope_parameters(cfg, "full_attention") == (1e6, "linear", (("factor", 4.0),))
    with pytest.raises(ValueError, match="no rope parameters for layer type 'chunked'"):
        get_rope_parameters(cfg, "chunked")
