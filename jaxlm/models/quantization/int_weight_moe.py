"""Integer-weight MoE experts (AWQ, GPTQ, compressed-tensors WNA16; vLLM's ``AWQMoEMethod``,
``GPTQMarlinMoEMethod``, ``CompressedTensorsWNA16MoEMethod``).

The Linear's one layout (int_weight.py), stacked per expert slot:

- ``gate_up_qweight`` int32 [S, H * bits / 32, 2, I], ``gate_up_scales`` [S, H / g, 2, I],
  ``gate_up_qzeros`` int8 [S, H / g, 2, I] (formats with zero points);
- ``down_qweight`` int32 [S, I * bits / 32, H], ``down_scales`` / ``down_qzeros`` [S, I / g, H].

Each expert's checkpoint tensors (``experts.{e}.{gate,up,down}_proj.{qweight,...}``) are
repacked on the host as they stream in by the format's own Linear method (``hf_tensors``) and
written into their expert's block. The product unpacks, offsets and scales each expert's
words inside the grouped product (``moe_ops``: per tile on CPU, every local expert for
ragged_dot), so the device holds the packed bytes.

Sharding follows the float experts: by expert under expert parallel; under tensor parallel
gate/up by output columns (scales and zeros with them) and down by input rows, in whole groups
(a per-channel down scale is one group, kept whole on every device).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.moe_ops import grouped_mlp
from jaxlm.models.quantization.base_config import FusedMoEMethodBase
from jaxlm.models.quantization.int_weight import PackedIntLinearMethod, dequantize
from jaxlm.models.quantization.params import zeros_param
from jaxlm.models.quantization.unquantized import ExpertTensor, expert_specs, stacked_expert_targets
from jaxlm.models.utils import WeightTarget


def int_expert_weight(parts: tuple[jax.Array, ...], dtype: Any, *, bits: int) -> tuple[jax.Array, None]:
    """moe_ops' Dequant: one expert's (qweight, scales[, qzeros]) -> its float weight [K, N]."""
    flat = [p.reshape(p.shape[0], -1) for p in parts]  # [rows, 2, I] -> [rows, 2I]
    zeros = flat[2] if len(flat) > 2 else None
    return dequantize(flat[0], flat[1], zeros, bits, dtype), None


@dataclasses.dataclass(frozen=True)
class PackedIntMoEMethod(FusedMoEMethodBase):
    """The experts of a packed-int format; ``linear`` is the format's Linear method (its bits,
    group size, zero points and tensor names)."""

    linear: PackedIntLinearMethod

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("qweight", "scales") + (("qzeros",) if self.linear.has_zeros else ())

    @property
    def param_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(f"{side}_{kind}" for side in ("gate_up", "down") for kind in self.kinds)

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        S, H, I = layer.num_slots, layer.hidden_size, layer.intermediate_size
        lin, pf = self.linear, 32 // self.linear.bits
        lin.check_shape(H, I)
        lin.check_shape(I, H)
        g_h, g_i = lin.group_for(H), lin.group_for(I)
        tp = layer.tp_size
        name = type(lin).__name__
        if tp > 1 and ((I // pf) % tp or (I // g_i > 1 and (I // g_i) % tp)):
            raise ValueError(f"{name}: tensor_parallel_size={tp} does not split the experts' down projection "
                             f"(input {I}, {I // pf} packed rows, {I // g_i} groups of {g_i}) into whole groups; "
                             "try --enable-expert-parallel")
        ep, tp_axis = expert_specs(layer)
        gu_spec = (ep, None, None, tp_axis)
        down_groups_axis = tp_axis if I // g_i > 1 else None
        layer.gate_up_qweight = zeros_param((S, H // pf, 2, I), jnp.int32, gu_spec)
        layer.gate_up_scales = zeros_param((S, H // g_h, 2, I), layer.dtype, gu_spec)
        layer.down_qweight = zeros_param((S, I // pf, H), jnp.int32, (ep, tp_axis, None))
        layer.down_scales = zeros_param((S, I // g_i, H), layer.dtype, (ep, down_groups_axis, None))
        if lin.has_zeros:
            layer.gate_up_qzeros = zeros_param((S, H // g_h, 2, I), jnp.int8, gu_spec)
            layer.down_qzeros = zeros_param((S, I // g_i, H), jnp.int8, (ep, down_groups_axis, None))

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        H, I, lin = layer.hidden_size, layer.intermediate_size, self.linear

        def tensors(proj: str) -> dict[str, ExpertTensor]:
            side, (i, o) = ("down", (I, H)) if proj == "down_proj" else ("gate_up", (H, I))
            return {suffix: (shape, (), [] if kind is None else [(getattr(layer, f"{side}_{kind}"), fn)])
                    for suffix, (shape, kind, fn) in lin.hf_tensors(i, o, lin.group_for(i)).items()}

        return stacked_expert_targets(layer, prefix, tensors)

    def apply(self, layer: nnx.Module, weights: tuple[jax.Array, ...], xs: jax.Array, expert_ids: jax.Array,
              first_expert: jax.Array, act: Any) -> jax.Array:
        n = len(self.kinds)
        return grouped_mlp(xs, expert_ids, weights[:n], weights[n:], first_expert, act,
                           dequant=functools.partial(int_expert_weight, bits=self.linear.bits))
