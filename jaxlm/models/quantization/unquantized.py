"""The float weights: one method among the others (vLLM's ``UnquantizedLinearMethod``,
``UnquantizedEmbeddingMethod`` and ``UnquantizedFusedMoEMethod``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.moe_ops import grouped_mlp
from jaxlm.models.quantization.base_config import FusedMoEMethodBase, LinearMethodBase, QuantizeMethodBase
from jaxlm.models.utils import HF_AS_IS, MODEL_AXIS, WeightTarget, make_param

# HF per-expert tensor names, in the order of the stacked gate_up dim (gate 0, up 1).
EXPERT_GATE_UP = ("gate_proj", "up_proj")


@dataclasses.dataclass(frozen=True)
class UnquantizedLinearMethod(LinearMethodBase):
    """``weight`` [in, out] in the model dtype."""

    param_names = ("weight",)

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        layer.weight = make_param(rngs, (layer.in_features, layer.out_features), layer.dtype,
                                  layer.parallel.weight_spec, hf_layout=layer.hf_layout, kv_repeat=layer.kv_repeat)

    def apply(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
        return x @ layer.weight[...]


@dataclasses.dataclass(frozen=True)
class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    """An ``Embedding``'s ``weight`` [num, dim] in the model dtype (vLLM's
    ``UnquantizedEmbeddingMethod``): a lookup takes rows, the tied LM head contracts dim 1."""

    param_names = ("weight",)

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        spec = (MODEL_AXIS, None) if layer.shard_vocab else (None, None)
        layer.weight = make_param(rngs, (layer.num, layer.dim), layer.dtype, spec, hf_layout=HF_AS_IS)

    def embedding(self, layer: nnx.Module, ids: jax.Array) -> jax.Array:
        return jnp.take(layer.weight[...], ids, axis=0)

    def attend(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
        # contracting W's dim 1: no transposed copy of the table
        return jax.lax.dot_general(x, layer.weight[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)


def expert_specs(layer: nnx.Module) -> tuple[str | None, str | None]:
    """(experts axis, intermediate axis) of a FusedExperts: split by experts under expert
    parallel, else by the intermediate size."""
    return (MODEL_AXIS, None) if layer.expert_parallel else (None, MODEL_AXIS)


# One checkpoint tensor of one expert's projection: (HF shape, other shapes it may come in,
# [(stacked Param, HF array -> this expert's block without the expert and gate/up dims)]).
ExpertTensor = tuple[tuple[int, ...], tuple[tuple[int, ...], ...], list[tuple[nnx.Variable, Callable]]]


def _block(fn: Callable, j: int | None) -> Callable:
    # gate/up Params hold the (gate, up) dim second to last: [S, ..., 2, N]; down ones [S, ...].
    if j is None:
        return lambda a: fn(a)[None]
    return lambda a: np.expand_dims(fn(a), -2)[None]


def stacked_expert_targets(layer: nnx.Module, prefix: str,
                           tensors: Callable[[str], dict[str, ExpertTensor]]) -> dict[str, WeightTarget]:
    """HF's per-expert tensors ``{prefix}.{e}.{gate,up,down}_proj.{suffix}``, each written into
    its expert's block of the stacked Params as it streams in (any method's layout:
    ``tensors(proj)`` says, per suffix, which Params it fills and how)."""
    targets: dict[str, WeightTarget] = {}
    for e, slot in enumerate(layer.slots):
        for j, proj in enumerate(EXPERT_GATE_UP + ("down_proj",)):
            gate_up = j if j < 2 else None
            for suffix, (shape, alts, parts) in tensors(proj).items():
                ranks = {p.get_value().ndim for p, _ in parts}
                assert len(ranks) <= 1, (proj, suffix)  # one starts tuple serves every part
                rank = ranks.pop() if ranks else 2
                starts = ((slot,) + (0,) * (rank - 1) if gate_up is None
                          else (slot,) + (0,) * (rank - 3) + (gate_up, 0))
                targets[f"{prefix}.{e}.{proj}.{suffix}"] = WeightTarget(
                    shape, [(p, _block(fn, gate_up)) for p, fn in parts], starts=starts, alt_shapes=alts)
    return targets


def transposed(a: np.ndarray) -> np.ndarray:
    """HF's [out, in] -> ours [in, out] (a view: the block is copied onto the device)."""
    return a.T


@dataclasses.dataclass(frozen=True)
class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """``gate_up_proj`` [S, hidden, 2, I] (gate, up) and ``down_proj`` [S, I, hidden]: S slots,
    expert e in ``layer.slots[e]`` (models/moe.py: expert_slots)."""

    param_names = ("gate_up_proj", "down_proj")

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        S, H, I = layer.num_slots, layer.hidden_size, layer.intermediate_size
        ep, tp = expert_specs(layer)
        layer.gate_up_proj = make_param(rngs, (S, H, 2, I), layer.dtype, (ep, None, None, tp))
        layer.down_proj = make_param(rngs, (S, I, H), layer.dtype, (ep, tp, None))

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        """HF's per-expert tensors ``{prefix}.{e}.{gate,up,down}_proj.weight`` ([out, in])."""
        H, I = layer.hidden_size, layer.intermediate_size

        def tensors(proj: str) -> dict[str, ExpertTensor]:
            if proj == "down_proj":
                return {"weight": ((H, I), (), [(layer.down_proj, transposed)])}
            return {"weight": ((I, H), (), [(layer.gate_up_proj, transposed)])}

        return stacked_expert_targets(layer, prefix, tensors)

    def apply(self, layer: nnx.Module, weights: tuple[jax.Array, ...], xs: jax.Array, expert_ids: jax.Array,
              first_expert: jax.Array, act: Any) -> jax.Array:
        w_gate_up, w_down = weights
        return grouped_mlp(xs, expert_ids, w_gate_up, w_down, first_expert, act)
