"""The quantization seam: a config's method replaces each Linear's weights, loads them its own
way, processes them once after loading and computes the product; routers stay float; an
unsupported quant_method is refused naming it."""

from __future__ import annotations

import dataclasses
import os
import types

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file

from jaxlm.attention.backends import get_attention_backend
from jaxlm.models import get_model_architecture
from jaxlm.models.quantization import (
    LinearMethodBase, QuantizationConfig, UnquantizedFusedMoEMethod, UnquantizedLinearMethod,
    get_quantization_config)
from jaxlm.models.quantization.model_quant import process_weights_after_loading, quantizable_layers
from jaxlm.models.utils import HF_AS_IS, make_param
from tests.helpers import tiny_models as tm
from tests.models import _parity


@dataclasses.dataclass(frozen=True)
class _TransposeOnceMethod(LinearMethodBase):
    """Keeps the checkpoint's [out, in] weight as it is at load and transposes it once after."""

    param_names = ("weight",)

    def create_weights(self, layer, rngs) -> None:
        spec = layer.parallel.weight_spec[::-1]
        layer.weight = make_param(rngs, (layer.out_features, layer.in_features), layer.dtype, spec,
                                  hf_layout=HF_AS_IS)

    def process_weights_after_loading(self, layer) -> None:
        layer.weight.set_value(layer.weight[...].T)

    def apply(self, layer, x):
        return x @ layer.weight[...]


@dataclasses.dataclass(frozen=True)
class _HalvedExpertsMethod(UnquantizedFusedMoEMethod):
    """The float experts stored doubled after loading and halved in the product."""

    def process_weights_after_loading(self, layer) -> None:
        for name in self.param_names:
            getattr(layer, name).set_value(getattr(layer, name)[...] * 2)

    def apply(self, layer, weights, xs, expert_ids, first_expert, act):
        return super().apply(layer, tuple(w / 2 for w in weights), xs, expert_ids, first_expert, act)


@dataclasses.dataclass(frozen=True)
class _ToyConfig(QuantizationConfig):
    skip: str = "gate_proj"

    @classmethod
    def get_name(cls) -> str:
        return "toy"

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_quant_method(self, layer, prefix):
        if prefix.endswith(".experts"):
            return _HalvedExpertsMethod()
        return None if prefix.endswith(self.skip) else _TransposeOnceMethod()


def _build(path: str, quant_config):
    """_parity.build_model with ``quant_config`` handed to the family's constructor, then
    processed as the loader does."""
    config = transformers.AutoConfig.from_pretrained(path)
    cls = get_model_architecture(config)
    model = nnx.eval_shape(lambda: cls(config, dtype=jnp.float32, attn_backend=get_attention_backend("xla"),
                                       rngs=nnx.Rngs(0), quant_config=quant_config))
    weights = load_file(os.path.join(path, "model.safetensors"))
    assert model.expected_weight_names() == set(model.load_weights(iter(weights.items())))
    return model, config, cls


def _logits(built, tokens):
    return _parity.JaxRunner(*built).run({0: tokens})


def test_a_config_method_loads_processes_and_applies(tmp_path) -> None:
    path = tm.make_tiny_llama(tmp_path / "llama")
    ref = _parity.build_model(path)
    built = _build(path, _ToyConfig())
    model = built[0]
    methods = {prefix: type(layer.quant_method) for prefix, layer in quantizable_layers(model)}
    assert methods["model.layers.0.self_attn.q_proj"] is _TransposeOnceMethod
    assert methods["model.layers.1.mlp.gate_proj"] is UnquantizedLinearMethod
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.get_value().shape == (q.out_features, q.in_features)  # as the checkpoint holds it
    process_weights_after_loading(model)
    assert q.weight.get_value().shape == (q.in_features, q.out_features)
    ref_q = ref[0].model.layers[0].self_attn.q_proj
    np.testing.assert_array_equal(np.asarray(q.weight[...]), np.asarray(ref_q.weight[...]))
    tokens = [5, 9, 3, 7, 11]
    np.testing.assert_allclose(_logits(built, tokens), _logits(ref, tokens), atol=1e-5)


def test_moe_experts_get_the_method_and_routers_stay_float(tmp_path) -> None:
    path = tm.make_tiny_model("qwen2_moe", tmp_path / "moe")
    ref = _parity.build_model(path)
    built = _build(path, _ToyConfig(skip="<none>"))
    process_weights_after_loading(built[0])
    methods = {prefix: type(layer.quant_method) for prefix, layer in quantizable_layers(built[0])}
    assert methods["model.layers.1.mlp.experts"] is _HalvedExpertsMethod
    assert methods["model.layers.1.mlp.gate"] is UnquantizedLinearMethod  # the router
    assert methods["model.layers.1.mlp.shared_expert_gate"] is UnquantizedLinearMethod
    assert methods["model.layers.1.mlp.shared_expert.up_proj"] is _TransposeOnceMethod
    experts = built[0].model.layers[1].mlp.experts
    np.testing.assert_allclose(np.asarray(experts.down_proj[...]),
                               2 * np.asarray(ref[0].model.layers[1].mlp.experts.down_proj[...]))
    tokens = [5, 9, 3, 7, 11, 40, 41]
    np.testing.assert_allclose(_logits(built, tokens), _logits(ref, tokens), atol=1e-5)


def test_unsupported_quant_method_is_refused_naming_it() -> None:
    hf_config = types.SimpleNamespace(quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported.*supported:"):
        get_quantization_config(None, hf_config)
    with pytest.raises(ValueError, match="'hqq' is not supported"):
        get_quantization_config("hqq", types.SimpleNamespace())
    assert get_quantization_config(None, types.SimpleNamespace()) is None
