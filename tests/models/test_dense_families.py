"""Gemma 3, Phi-3 / Phi-4-mini, SmolLM3 and Granite: logits and greedy tokens equal transformers'
(float32) on tiny random checkpoints with each family's differences switched on and awkward
shapes (tests/helpers/tiny_models.py: _DENSE_FAMILIES). Under the engine (chunked prefill,
preemption, prefix caching, TP=2): tests/models/test_dense_families_engine.py."""

from __future__ import annotations

import types

import numpy as np
import pytest
import transformers

from jaxlm.models import gemma3
from jaxlm.models.rotary import RotaryEmbedding
from tests.helpers import tiny_models as tm
from tests.models._parity import assert_parity, run_parity


def _prompts(lens) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, n).tolist() for n in lens]


CASES = {
    # name: (family, config overrides, prompt lengths, decode steps, prefill chunk, max_model_len)
    # 3 local layers per global, window 4 < every prompt, head_dim 32 != 64 / 4.
    "gemma3": ("gemma3", {}, (5, 11, 17), 32, None, None),
    # Partial rotary, GQA, longrope past original_max_position_embeddings (16): max_model_len
    # 256 > 16 selects the long factors, and every sequence here is longer than 16, so
    # transformers uses them too.
    "phi3_longrope_beyond_original": ("phi3", {}, (5, 11, 17), 32, None, 256),
    # max_model_len 16 keeps the short factors; sequences stay within 16 tokens.
    "phi3_longrope_short_within_original": ("phi3", {}, (3, 6, 9), 7, None, 16),
    # Layers 1 and 3 without rope.
    "smollm3_nope_layers": ("smollm3", {}, (5, 11, 17), 32, None, None),
    # All four multipliers != 1.
    "granite_multipliers": ("granite", {}, (5, 11, 17), 32, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_parity(case: str, tmp_path, record_property) -> None:
    family, overrides, lens, steps, chunk, max_model_len = CASES[case]
    path = tm.make_tiny_model(family, tmp_path / case, **overrides)
    res = run_parity(path, _prompts(lens), steps=steps, chunk=chunk, max_model_len=max_model_len)
    assert_parity(res, case, record_property)


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path) -> None:
    """Gemma 3 4B and up are published as Gemma3ForConditionalGeneration (a vision tower beside
    the language model): the engine runs on its text_config and reads the language model's
    weights from under their prefix; logits equal transformers' on text."""
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import resolve_model_config

    path = tm.make_tiny_model("gemma3_mm", tmp_path / "gemma3_mm")
    mc = resolve_model_config(ModelConfig(model=path), LoadConfig())
    assert type(mc.hf_config).__name__ == "Gemma3TextConfig"
    assert mc.hf_config.architectures == ["Gemma3ForConditionalGeneration"]
    assert (mc.hf_config.vocab_size, mc.max_model_len) == (tm.VOCAB_SIZE, 256)
    assert_parity(run_parity(path, _prompts((5, 11, 17)), steps=8), "gemma3_mm")


def test_gemma3_through_the_pallas_kernels(tmp_path) -> None:
    """Per-layer windows (4 on local layers, none on global ones) and Gemma's attention scale
    reach the Pallas kernels (interpret mode on CPU): prompts in chunks of 5 read the window
    from the cache, then decode steps."""
    path = tm.make_tiny_model("gemma3", tmp_path / "gemma3")
    assert_parity(run_parity(path, _prompts((9, 14)), steps=2, chunk=5, backend="pallas"), "gemma3_pallas")


def test_gemma3_transformers4_config_layout_gives_the_same_layers() -> None:
    """4.x configs carry rope_theta/rope_scaling (global), rope_local_base_freq and
    sliding_window_pattern instead of 5.x's per-layer-type rope_parameters and layer_types."""
    old = types.SimpleNamespace(num_hidden_layers=6, sliding_window_pattern=3, rope_theta=1e6,
                                rope_scaling=dict(rope_type="linear", factor=8.0), rope_local_base_freq=1e4)
    new = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window_pattern=3, rope_theta=1e6,
                                        rope_scaling=dict(rope_type="linear", factor=8.0), rope_local_base_freq=1e4)
    assert gemma3.layer_types(old) == gemma3.layer_types(new) == ("sliding_attention", "sliding_attention",
                                                                 "full_attention") * 2
    local, glob = RotaryEmbedding(32, 1e4), RotaryEmbedding(32, 1e6, "linear", (("factor", 8.0),))
    assert gemma3.layer_ropes(old, 32) == gemma3.layer_ropes(new, 32) == (local, local, glob) * 2


@pytest.mark.parametrize("family,key,value,message", [
    ("gemma3", "query_pre_attn_scalar", 0, "query_pre_attn_scalar=0: must be a finite number > 0"),
    ("gemma3", "query_pre_attn_scalar", -4, "query_pre_attn_scalar=-4: must be a finite number > 0"),
    ("gemma3", "final_logit_softcapping", float("nan"), "final_logit_softcapping=nan"),
    ("gemma3", "sliding_window", 0, "sliding_window=0: must be a finite number > 0"),
    ("granite", "logits_scaling", 0.0, "logits_scaling=0.0: must be a finite number > 0"),
    ("granite", "attention_multiplier", float("inf"), "attention_multiplier=inf"),
    ("granite", "embedding_multiplier", -3.0, "embedding_multiplier=-3.0: must be a finite number > 0"),
    ("smollm3", "no_rope_layer_interval", 0, "no_rope_layer_interval=0: must be an integer >= 1"),
    ("phi3", "partial_rotary_factor", 1.5, r"partial_rotary_factor=1.5: must be in \(0, 1\]"),
])
def test_bad_config_values_are_named(family, key, value, message) -> None:
    import jax.numpy as jnp
    from flax import nnx

    from jaxlm.models.registry import ModelRegistry

    cfg = tm.tiny_config(family)
    if key == "partial_rotary_factor":
        cfg.rope_parameters[key] = value
    else:
        setattr(cfg, key, value)
    if family == "smollm3":
        cfg.no_rope_layers = None  # derived from the interval
    arch = {"gemma3": "Gemma3ForCausalLM", "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM",
            "phi3": "Phi3ForCausalLM"}[family]
    cls, _ = ModelRegistry.resolve_model_cls([arch])
    with pytest.raises(ValueError, match=message):
        nnx.eval_shape(lambda: cls(cfg, dtype=jnp.float32, attn_backend=None, rngs=nnx.Rngs(0)))
