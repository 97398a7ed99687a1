"""fp8 weights (vLLM's ``fp8`` method): e4m3 ``weight`` with a float32 ``weight_scale``.

- Checkpoints quantized offline (``quant_method: fp8``, as vLLM and llm-compressor's FP8
  checkpoints ship): per-tensor ``weight_scale`` (and ``input_scale`` under
  ``activation_scheme: static``); compressed-tensors' ``float-quantized`` layers use the same
  method with per-channel scales (``compressed_tensors.py``).
- Online (``--quantization fp8`` on a float checkpoint): the float weight is loaded, then
  ``process_weights_after_loading`` quantizes it per output channel on its devices, layer by
  layer, and the float copy is dropped.

The weight is kept [in, out] in e4m3 (1 byte a weight) and its scale per output column is
sharded with the output features (a column-parallel layer's scale is split like its columns; a
row-parallel one's is whole). The product: XLA's fp8 dot on CUDA, else the weight converted to
the activations' dtype inside the compiled product (``fp8_utils.fp8_linear``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.quantization.base_config import LinearMethodBase, QuantizationConfig, QuantizeMethodBase
from jaxlm.models.quantization.fp8_moe import Fp8MoEMethod
from jaxlm.models.quantization.fp8_utils import FP8_DTYPE, fp8_linear, quantize_per_channel
from jaxlm.models.quantization.params import replace_params, zeros_param
from jaxlm.models.utils import HF_TRANSPOSE, WeightTarget, make_param, to_param_layout


def _scalar(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).reshape(1)


@dataclasses.dataclass(frozen=True)
class Fp8LinearMethod(LinearMethodBase):
    """``serialized``: the checkpoint holds e4m3 weights (else float ones, quantized after
    loading); ``per_channel``: ``weight_scale`` per output feature (else one per tensor);
    ``static_input_scale``: the checkpoint's ``input_scale`` quantizes the activations of the
    fp8 dot."""

    serialized: bool = True
    per_channel: bool = False
    static_input_scale: bool = False

    @property
    def param_names(self) -> tuple[str, ...]:  # type: ignore[override]
        if not self.serialized:
            return ("weight",)
        return ("weight", "weight_scale") + (("input_scale",) if self.static_input_scale else ())

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        dtype = FP8_DTYPE if self.serialized else layer.dtype
        layer.weight = make_param(rngs, (layer.in_features, layer.out_features), dtype, layer.parallel.weight_spec,
                                  init="zeros" if self.serialized else "normal", hf_layout=HF_TRANSPOSE,
                                  kv_repeat=layer.kv_repeat)
        if not self.serialized:
            return
        out_spec = (layer.parallel.weight_spec[1],)
        if self.per_channel:
            layer.weight_scale = zeros_param((layer.out_features,), jnp.float32, out_spec, kv_repeat=layer.kv_repeat)
        else:
            layer.weight_scale = zeros_param((1,), jnp.float32, (None,))
        if self.static_input_scale:
            layer.input_scale = zeros_param((1,), jnp.float32, (None,))

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        targets = super().weight_targets(layer, prefix)
        if not self.serialized:
            return targets
        hf_out = targets[f"{prefix}.weight"].hf_shape[0]
        if self.per_channel:  # compressed-tensors' channel scales: [out, 1]
            scale = layer.weight_scale
            targets[f"{prefix}.weight_scale"] = WeightTarget(
                (hf_out, 1), [(scale, lambda a: to_param_layout(scale, np.asarray(a, np.float32).reshape(-1)))],
                alt_shapes=((hf_out,),))
        else:  # one scale: [] (vLLM's fp8) or [1] (compressed-tensors' tensor strategy)
            targets[f"{prefix}.weight_scale"] = WeightTarget((), [(layer.weight_scale, _scalar)],
                                                             alt_shapes=((1,),))
        if self.static_input_scale:
            targets[f"{prefix}.input_scale"] = WeightTarget((), [(layer.input_scale, _scalar)],
                                                            alt_shapes=((1,),))
        return targets

    def process_weights_after_loading(self, layer: nnx.Module) -> None:
        if self.serialized:
            return
        # Online: this layer's float weight -> e4m3 + per-column scale, on the weight's devices.
        spec = tuple(layer.weight.get_metadata().get("out_sharding"))
        replace_params(layer, quantize_per_channel, ["weight"],
                       {"weight": (FP8_DTYPE, spec), "weight_scale": (jnp.float32, (spec[1],))})

    def remove_weights(self, layer: nnx.Module) -> None:
        for name in ("weight", "weight_scale", "input_scale"):
            if hasattr(layer, name):
                delattr(layer, name)

    def apply(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
        input_scale = layer.input_scale[...] if self.static_input_scale else None
        return fp8_linear(x, layer.weight[...], layer.weight_scale[...], input_scale)


@dataclasses.dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """vLLM's ``Fp8Config``: ``is_checkpoint_fp8_serialized`` when the checkpoint says
    ``quant_method: fp8``; online per-channel quantization for ``--quantization fp8`` alone."""

    is_checkpoint_fp8_serialized: bool = False
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = ()

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        if not config:
            return cls()
        scheme = str(config.get("activation_scheme", "dynamic"))
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8 checkpoint: unsupported activation_scheme {scheme!r} (static or dynamic)")
        if config.get("weight_block_size"):
            raise ValueError(f"fp8 checkpoint: block-wise scales (weight_block_size={config['weight_block_size']}) "
                             "are not supported; jaxlm reads per-tensor fp8 checkpoints and compressed-tensors' "
                             "per-channel ones")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
        return cls(is_checkpoint_fp8_serialized=True, activation_scheme=scheme, ignored_layers=tuple(ignored))

    def get_quant_method(self, layer: nnx.Module, prefix: str) -> QuantizeMethodBase | None:
        if is_ignored(prefix, self.ignored_layers):
            return None
        if not hasattr(layer, "in_features"):  # the stacked MoE experts
            if not self.is_checkpoint_fp8_serialized:
                return Fp8MoEMethod(serialized=False)
            return Fp8MoEMethod(serialized=True, static_input_scale=self.activation_scheme == "static")
        if not self.is_checkpoint_fp8_serialized:
            return Fp8LinearMethod(serialized=False, per_channel=True)
        return Fp8LinearMethod(serialized=True, per_channel=False,
                               static_input_scale=self.activation_scheme == "static")

    def describe(self) -> str:
        kind = "checkpoint, per-tensor" if self.is_checkpoint_fp8_serialized else "online, per-channel"
        return f"fp8 ({kind})"


def is_ignored(prefix: str, ignored: tuple[str, ...]) -> bool:
    """vLLM's ignore lists: a module name, a name's last part, or ``re:<regex>``."""
    import re

    for entry in ignored:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], prefix) or re.match(entry[3:], prefix):
                return True
        elif prefix == entry or prefix.endswith("." + entry):
            return True
    return False
