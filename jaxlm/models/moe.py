"""The mixture-of-experts block (vLLM's ``FusedMoE``), shared by every MoE family.

One block, configured per family by ``MoEArgs``: a float32 router (softmax, top-k, optional
renormalisation), the experts stacked into ``[num_experts, ...]`` Params, and an optional shared
expert with a sigmoid gate (Qwen2-MoE). The math lives in ``moe_ops``.

Placement over the mesh's ``model`` axis (tensor parallel size tp):
- without expert parallelism, every expert's matrices are split like the dense MLP's (gate/up
  by output columns, down by input rows), so each device computes its slice of every expert;
- with ``enable_expert_parallel``, each device holds whole experts, as evenly as they go
  (vLLM's ``determine_expert_map``: the first num_experts % tp devices hold one more; 10 experts
  on 4 devices are 3, 3, 2, 2). The stacked Params keep ceil(num_experts / tp) slots per device
  (``expert_slots``); a device with fewer experts leaves its last slot zero, and the router's
  expert ids are mapped to slots, so no token reaches a padding slot.
Either way the activations entering the block are replicated over ``model`` (attention's
output projection already reduced them), so every device routes all tokens itself, computes
the rows of the experts (or slices) it holds under ``shard_map``, and one ``psum`` of the
[T, hidden] partial outputs -- the same all-reduce the dense MLP's down projection costs --
gives every device the result. No token is dropped and no buffer depends on routing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlm.models.layers import Linear, ParallelStyle, get_act_fn
from jaxlm.models.moe_ops import combine, route, sort_by_expert
from jaxlm.models.quantization.base_config import FusedMoEMethodBase
from jaxlm.models.quantization.unquantized import UnquantizedFusedMoEMethod
from jaxlm.models.utils import MODEL_AXIS, WeightTarget, get_param_partition_spec

@dataclasses.dataclass(frozen=True)
class MoEArgs:
    """The MoE numbers of an HF config (hashable)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights rescaled to sum 1 (Mixtral; norm_topk_prob elsewhere)
    sparse_layers: tuple[bool, ...]  # per layer: MoE block, or the dense MLP
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    @classmethod
    def from_hf_config(cls, config: Any, *, num_experts: int, intermediate_size: int,
                       renormalize: bool, shared_expert_intermediate_size: int = 0) -> "MoEArgs":
        """Dense layers between sparse ones as Qwen-MoE places them: a layer is sparse unless it
        is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``."""
        n_layers = config.num_hidden_layers
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        top_k = int(config.num_experts_per_tok)
        for name, value in (("num_experts", num_experts), ("the experts' intermediate size", intermediate_size),
                            ("decoder_sparse_step", step)):
            if int(value) < 1:
                raise ValueError(f"the model config's {name} must be >= 1, got {value}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        return cls(
            num_experts=int(num_experts),
            top_k=top_k,
            intermediate_size=int(intermediate_size),
            renormalize=bool(renormalize),
            sparse_layers=tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)),
            shared_expert_intermediate_size=int(shared_expert_intermediate_size or 0),
        )

    def check_parallel(self, tp: int, expert_parallel: bool) -> None:
        """A clear error when ``tp`` does not divide what it splits, naming both numbers (whole
        experts need not divide: expert_slots)."""
        if tp == 1 or expert_parallel:
            return
        if self.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the experts' intermediate size "
                f"{self.intermediate_size}; try --enable-expert-parallel")
        if self.shared_expert_intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                             f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}")


def expert_slots(num_experts: int, ep_size: int) -> tuple[int, ...]:
    """Expert e's index in the stacked Params when ``ep_size`` devices hold whole experts: device
    d holds the experts vLLM's determine_expert_map gives it (num_experts // ep_size, one more on
    the first num_experts % ep_size devices; contiguous, in order) in its block of
    ceil(num_experts / ep_size) slots. The identity when ep_size divides num_experts."""
    base, extra = divmod(num_experts, ep_size)
    per_device = base + (extra > 0)
    return tuple(d * per_device + i for d in range(ep_size) for i in range(base + (d < extra)))


class FusedExperts(nnx.Module):
    """Every expert's gated MLP, stacked; the Params and the grouped product belong to the
    layer's ``quant_method`` (float: ``gate_up_proj`` [S, hidden, 2, I] (gate, up) and
    ``down_proj`` [S, I, hidden]), expert e in slot ``slots[e]`` (S = E but under expert
    parallelism over ``ep_size`` devices that E does not divide: expert_slots). Split over
    ``model`` (``ep_size`` devices) by experts (expert parallel) or by I (``tp_size`` devices)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, expert_parallel: bool,
                 dtype: jnp.dtype, rngs: nnx.Rngs, ep_size: int = 1):
        self.num_experts, self.hidden_size, self.intermediate_size = int(num_experts), int(hidden), int(intermediate)
        self.expert_parallel = bool(expert_parallel)
        # Devices that split each expert's intermediate size (TP without EP): a quantized
        # method checks its row groups divide evenly.
        self.tp_size = 1 if expert_parallel else int(ep_size)
        self.slots = expert_slots(num_experts, ep_size if expert_parallel else 1)
        self.num_slots = -(-num_experts // ep_size) * ep_size if expert_parallel else num_experts
        self.dtype = jnp.dtype(dtype)
        self.quant_method: FusedMoEMethodBase = UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, rngs)

    @property
    def padded(self) -> bool:
        return self.slots != tuple(range(len(self.slots)))

    def set_quant_method(self, method: FusedMoEMethodBase, rngs: nnx.Rngs) -> None:
        """Replace the stacked weights with ``method``'s (the model is still abstract)."""
        self.quant_method.remove_weights(self)
        self.quant_method = method
        method.create_weights(self, rngs)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """HF's per-expert tensors (``{prefix}.{e}.{gate,up,down}_proj...``), as the method loads them
        (padding slots stay zero)."""
        return self.quant_method.weight_targets(self, prefix)


class FusedMoE(nnx.Module):
    """Router (``gate``), experts, and an optional shared expert (``shared_expert`` with its
    sigmoid ``shared_expert_gate``); HF's names."""

    def __init__(self, hidden: int, moe: MoEArgs, act: str, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 mesh: Any = None, expert_parallel: bool = False, shared_expert: nnx.Module | None = None):
        get_act_fn(act)  # fail at construction, not at the first step
        self.act = act
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        # The mesh shard_map runs over (None: one device, or a "model" axis of 1).
        self.mesh = mesh if mesh is not None and mesh.shape.get(MODEL_AXIS, 1) > 1 else None
        self.expert_parallel = bool(expert_parallel)
        # The routers stay float under any quantization (as vLLM builds them).
        self.gate = Linear(hidden, moe.num_experts, bias=False, parallel=ParallelStyle.REPLICATED, dtype=dtype,
                           rngs=rngs, quantizable=False)
        self.experts = FusedExperts(moe.num_experts, hidden, moe.intermediate_size,
                                    expert_parallel=expert_parallel, dtype=dtype, rngs=rngs,
                                    ep_size=self.mesh.shape[MODEL_AXIS] if self.mesh is not None else 1)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            Linear(hidden, 1, bias=False, parallel=ParallelStyle.REPLICATED, dtype=dtype, rngs=rngs, quantizable=False)
            if shared_expert is not None else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        # The router in float32 whatever the model dtype: top-k picks must not flip with bf16.
        weights, ids = route(self.gate(x.astype(jnp.float32)), self.top_k, self.renormalize)
        y = self.routed_experts(x, weights, ids)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y

    def routed_experts(self, x: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, hidden]."""
        act = get_act_fn(self.act)
        sharded = self.mesh is not None
        ep = self.expert_parallel and sharded
        if self.experts.padded:  # expert ids -> their slots (an increasing map: the sort is the same)
            ids = jnp.asarray(np.array(self.experts.slots, np.int32))[ids]

        def local(x, weights, ids, *ws):
            order, es = sort_by_expert(ids)
            xs = x[order // self.top_k]
            # Every method's Params lead with the experts dim: this device's count of them.
            start = lax.axis_index(MODEL_AXIS) * ws[0].shape[0] if ep else 0
            ys = method.apply(self.experts, ws, xs, es, jnp.asarray(start, jnp.int32), act)
            out = combine(ys, order, weights).astype(x.dtype)
            return lax.psum(out, MODEL_AXIS) if sharded else out

        method = self.experts.quant_method
        variables = method.weights(self.experts)
        params = tuple(v[...] for v in variables)
        if not sharded:
            return local(x, weights, ids, *params)
        specs = tuple(get_param_partition_spec(v) for v in variables)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P(), P(), *specs), out_specs=P(),
                             check_vma=False)(x, weights, ids, *params)
