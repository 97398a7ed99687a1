"""fp8 MoE experts (vLLM's ``Fp8MoEMethod``; compressed-tensors' float-quantized experts too).

The stacked experts keep the float layout in e4m3 (1 byte a weight): ``gate_up_proj`` [S, H, 2,
I] and ``down_proj`` [S, I, H], with float32 scales per (expert, output column):
``gate_up_scale`` [S, 2, I] and ``down_scale`` [S, H]. One layout for every source:

- vLLM's fp8 checkpoints: ``experts.{e}.{gate,up,down}_proj.weight`` e4m3 with a scalar
  ``weight_scale`` each (Mixtral's ``w1/w3/w2`` are renamed by the family). Gate and up have
  separate per-tensor scales, so each is written over its own half's columns; ``input_scale``
  (static activation scheme) is read and not kept: the experts' product is weight-only.
- compressed-tensors float-quantized: ``weight_scale`` [out, 1] per channel (or [1]).
- online (``--quantization fp8``): the float experts load as usual and
  ``process_weights_after_loading`` quantizes them per output channel on their devices, one
  layer at a time.

The scales shard with their columns: gate/up's split like I under tensor parallel, down's whole
(its output is the hidden size); all by expert under expert parallel. The product (``apply``)
converts each expert's e4m3 weight to the activations' dtype inside the grouped product and
scales the output columns (``moe_ops``), except on CUDA, where ragged_dot takes e4m3 operands
(``fp8_grouped_dot``: the activations quantized per tensor, as the fp8 Linear does on CUDA).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxlm.models.moe_ops import RaggedProducts, dequant_ragged, grouped_mlp
from jaxlm.models.quantization.base_config import FusedMoEMethodBase
from jaxlm.models.quantization.fp8_utils import FP8_DTYPE, FP8_MAX, TINY, quantize_activations
from jaxlm.models.quantization.params import replace_params, zeros_param
from jaxlm.models.quantization.unquantized import (
    ExpertTensor, UnquantizedFusedMoEMethod, expert_specs, stacked_expert_targets, transposed)
from jaxlm.models.utils import WeightTarget

_ALL = ("gate_up_proj", "gate_up_scale", "down_proj", "down_scale")


def quantize_experts(gate_up: jax.Array, down: jax.Array) -> tuple[jax.Array, ...]:
    """Float stacked experts -> e4m3 and per-(expert, output column) scales: the maximum runs over
    each expert's input dim (gate_up [S, H, 2, I] -> scale [S, 2, I]; down [S, I, H] -> [S, H])."""
    out = []
    for w in (gate_up, down):
        wf = w.astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=1), TINY) / FP8_MAX
        out += [jnp.clip(wf / jnp.expand_dims(scale, 1), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scale]
    return tuple(out)


def fp8_expert_weight(parts: tuple[jax.Array, ...], dtype: Any) -> tuple[jax.Array, jax.Array]:
    """moe_ops' Dequant: one expert's e4m3 weight in ``dtype`` (exact) and its column scales."""
    w, scale = parts
    return w.reshape(w.shape[0], -1).astype(dtype), scale.reshape(-1)


def fp8_grouped_dot(x: jax.Array, parts: tuple[jax.Array, ...], sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
    """moe_ops' RaggedProduct on CUDA: x quantized to e4m3 with its own per-tensor amax (as the
    fp8 Linear's dynamic scheme), one ragged_dot of e4m3 operands accumulating in float32
    (Hopper's fp8 tensor cores), x's scale and each row's expert column scales on the output."""
    w, scale = parts
    w = w.reshape(*w.shape[:2], -1)
    x8, x_scale = quantize_activations(x)
    y = lax.ragged_dot(x8, w, sizes, preferred_element_type=jnp.float32)
    return (y * (x_scale * scale.reshape(scale.shape[0], -1).astype(jnp.float32)[row_expert])).astype(x.dtype)


def _fp8_ragged(x: jax.Array, parts: tuple[jax.Array, ...], sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
    """The fp8 grouped dot on CUDA; elsewhere (no fp8 units, or TPU) the experts dequantized."""
    return lax.platform_dependent(x, parts, sizes, row_expert, cuda=fp8_grouped_dot,
                                  default=dequant_ragged(fp8_expert_weight))


FP8_RAGGED = RaggedProducts(_fp8_ragged, _fp8_ragged)


def _full(n: int):
    # One per-tensor scale repeated over the columns it covers.
    return lambda a: np.full((n,), float(np.asarray(a, np.float32).reshape(-1)[0]), np.float32)


def _column(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Fp8MoEMethod(FusedMoEMethodBase):
    """``serialized``: the checkpoint holds e4m3 experts (else float ones, quantized after
    loading); ``per_channel``: their ``weight_scale`` per output feature (else one a tensor);
    ``static_input_scale``: each also has an ``input_scale`` (read, not used)."""

    serialized: bool = True
    per_channel: bool = False
    static_input_scale: bool = False

    @property
    def param_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return _ALL if self.serialized else UnquantizedFusedMoEMethod.param_names

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        if not self.serialized:  # the float experts, quantized once loaded
            UnquantizedFusedMoEMethod().create_weights(layer, rngs)
            return
        S, H, I = layer.num_slots, layer.hidden_size, layer.intermediate_size
        ep, tp = expert_specs(layer)
        layer.gate_up_proj = zeros_param((S, H, 2, I), FP8_DTYPE, (ep, None, None, tp))
        layer.gate_up_scale = zeros_param((S, 2, I), jnp.float32, (ep, None, tp))
        layer.down_proj = zeros_param((S, I, H), FP8_DTYPE, (ep, tp, None))
        layer.down_scale = zeros_param((S, H), jnp.float32, (ep, None))

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        if not self.serialized:
            return UnquantizedFusedMoEMethod().weight_targets(layer, prefix)
        H, I = layer.hidden_size, layer.intermediate_size

        def tensors(proj: str) -> dict[str, ExpertTensor]:
            down = proj == "down_proj"
            out, inp = (H, I) if down else (I, H)
            weight, scale = ((layer.down_proj, layer.down_scale) if down
                             else (layer.gate_up_proj, layer.gate_up_scale))
            if self.per_channel:  # compressed-tensors' channel scales: [out, 1]
                scale_entry = ((out, 1), ((out,),), [(scale, _column)])
            else:  # [] (vLLM's fp8) or [1] (compressed-tensors' tensor strategy)
                scale_entry = ((), ((1,),), [(scale, _full(out))])
            entries = {"weight": ((out, inp), (), [(weight, transposed)]), "weight_scale": scale_entry}
            if self.static_input_scale:
                entries["input_scale"] = ((), ((1,),), [])
            return entries

        return stacked_expert_targets(layer, prefix, tensors)

    def process_weights_after_loading(self, layer: nnx.Module) -> None:
        if self.serialized:
            return
        # Online: this layer's float experts -> e4m3 + column scales, on their devices.
        ep, tp = expert_specs(layer)
        replace_params(layer, quantize_experts, ["gate_up_proj", "down_proj"], {
            "gate_up_proj": (FP8_DTYPE, (ep, None, None, tp)), "gate_up_scale": (jnp.float32, (ep, None, tp)),
            "down_proj": (FP8_DTYPE, (ep, tp, None)), "down_scale": (jnp.float32, (ep, None))})

    def weights(self, layer: nnx.Module) -> tuple[nnx.Variable, ...]:
        return tuple(getattr(layer, name) for name in _ALL)

    def remove_weights(self, layer: nnx.Module) -> None:
        for name in _ALL:
            if hasattr(layer, name):
                delattr(layer, name)

    def apply(self, layer: nnx.Module, weights: tuple[jax.Array, ...], xs: jax.Array, expert_ids: jax.Array,
              first_expert: jax.Array, act: Any) -> jax.Array:
        w_gate_up, s_gate_up, w_down, s_down = weights
        return grouped_mlp(xs, expert_ids, (w_gate_up, s_gate_up), (w_down, s_down), first_expert, act,
                           dequant=fp8_expert_weight, ragged=FP8_RAGGED)
