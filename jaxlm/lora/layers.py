"""The adapters' delta inside the shared ``Linear``: stacked A/B slots and the per-token slot.

``install_lora`` gives every adaptable ``Linear`` (``lora/targets.py``) a ``LinearLoRA`` after
the base weights are loaded, so no family mentions LoRA and every family gets it. A
``LinearLoRA`` holds ``max_loras`` slots, each padded to ``max_lora_rank`` (R), side by side:
A [in, S*R] and B [S*R, out] (slot s = columns / rows s*R .. (s+1)*R, scale folded into B).
A step carries one slot index per token (-1: the base model); the layer computes

    y = x @ W + ((x @ A) * mask) @ B,    mask[t, c] = (slot[t] == c // R)

two dense matmuls of rank S*R. Chosen by measurement (``scripts/bench.py --lora-delta``; figures
in docs/ARCHITECTURE.md) over a per-token gather of A and B (7-15x the base linears on CPU),
``jax.lax.ragged_dot`` over tokens sorted by slot (2-4x: the sort and unsort gathers cost more
than the grouped matmul saves) and one matmul pair per slot (close at 64 tokens, dearer at 512).
"Off" is a mask row of zeros: no stored zero slot to multiply.

A step with no adapter at all skips the delta (``lax.cond`` on one scalar), so LoRA enabled but
unused costs nearly nothing. Tensor parallel: a column-parallel layer keeps A whole and splits B
over its output features; a row-parallel layer splits A over its input features and keeps B
whole, so (x_s @ A_s) is a partial sum like x_s @ W_s and XLA reduces both in the layer's one
all-reduce (the compiled HLO holds one all-reduce per row-parallel layer in each branch).

The per-token slots reach the layers through ``set_lora_step``, which the runner calls on the
model it merges inside the traced step (a per-trace value, like attention metadata; the
families' call signatures stay as they are).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.layers import Linear, ParallelStyle
from jaxlm.models.utils import MODEL_AXIS, place
from jaxlm.lora.targets import LoRATargets, lora_targets

# (A spec, B spec) per parallel style of the base layer.
_SPECS = {
    ParallelStyle.COLUMN: ((None, None), (None, MODEL_AXIS)),
    ParallelStyle.ROW: ((MODEL_AXIS, None), (None, None)),
    ParallelStyle.REPLICATED: ((None, None), (None, None)),
}


class LoRAWeight(nnx.Variable):
    """Stacked adapter slots: device state written by the slot manager, never a checkpoint Param."""


@dataclasses.dataclass(frozen=True)
class LoRAStep:
    """One traced step's adapter inputs: the [T, S*R] slot mask and whether any token uses one."""

    mask: jax.Array
    active: jax.Array


jax.tree_util.register_dataclass(LoRAStep, data_fields=["mask", "active"], meta_fields=[])


class LinearLoRA(nnx.Module):
    """The slots of one ``Linear``; called by it with the input and its base product (a thunk:
    whatever the layer's quantization method computes)."""

    def __init__(self, in_features: int, out_features: int, *, num_slots: int, rank: int,
                 parallel: ParallelStyle, kv_repeat: tuple[int, int] | None, dtype: Any):
        a_spec, b_spec = _SPECS[ParallelStyle(parallel)]
        width = num_slots * rank
        self.num_slots, self.rank = num_slots, rank
        # (repeats, head_dim) when the base layer holds each KV head several times (tensor parallel).
        self.kv_repeat = kv_repeat
        self.lora_a = LoRAWeight(jax.ShapeDtypeStruct((in_features, width), dtype), out_sharding=a_spec,
                                 eager_sharding=False)
        self.lora_b = LoRAWeight(jax.ShapeDtypeStruct((width, out_features), dtype), out_sharding=b_spec,
                                 eager_sharding=False)
        self.step = nnx.data(None)  # set per trace by set_lora_step

    def __call__(self, x: jax.Array, base: Callable[[], jax.Array]) -> jax.Array:
        step: LoRAStep | None = self.step
        if step is None:  # traced without a step (the sampler's logits): no adapter
            return base()

        def with_delta() -> jax.Array:
            return base() + ((x @ self.lora_a[...]) * step.mask) @ self.lora_b[...]

        # The base matmul sits in both branches so a row-parallel layer keeps one reduction.
        return jax.lax.cond(step.active, with_delta, base)


def lora_layers(model: nnx.Module) -> Iterator[tuple[str, LinearLoRA]]:
    """(path of the Linear, its LinearLoRA) for every adapted layer."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and node.lora is not None:
            yield ".".join(str(p) for p in path), node.lora


def install_lora(model: nnx.Module, num_slots: int, rank: int, mesh: Any) -> LoRATargets:
    """Give every adaptable Linear its (zero) slots, placed on the layer's sharding; returns
    the model's targets. Called once the base weights are loaded."""
    targets = lora_targets(model)
    linears = {".".join(str(p) for p in path): node for path, node in nnx.iter_graph(model)
               if isinstance(node, Linear)}
    for path in targets.modules:
        linear = linears[path]
        lora = LinearLoRA(linear.in_features, linear.out_features, num_slots=num_slots, rank=rank,
                          parallel=linear.parallel, kv_repeat=linear.kv_repeat, dtype=linear.dtype)
        for var in (lora.lora_a, lora.lora_b):
            shape, dtype = var.get_value().shape, var.get_value().dtype
            place(var, np.zeros(shape, dtype), dtype, mesh)
        linear.lora = lora
    return targets


def set_lora_step(model: nnx.Module, token_slots: jax.Array) -> None:
    """Hand a traced step's per-token slots ([T] int32, -1 = none) to every adapted layer."""
    layers = [lora for _, lora in lora_layers(model)]
    if not layers:
        return
    num_slots, rank = layers[0].num_slots, layers[0].rank
    columns = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank
    dtype = layers[0].lora_a.get_value().dtype
    step = LoRAStep(mask=(token_slots[:, None] == columns[None, :]).astype(dtype),
                    active=jnp.any(token_slots >= 0))
    for lora in layers:
        lora.step = step
