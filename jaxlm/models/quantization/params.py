"""Helpers the formats share: Params created with their sharding, replaced after loading on the
same devices, and the weight bytes a model holds."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxlm.models.utils import HF_AS_IS, make_param


def zeros_param(shape: Sequence[int], dtype: Any, spec: Sequence[str | None], **metadata: Any) -> nnx.Param:
    """A Param filled only by the checkpoint (abstract under ``nnx.eval_shape``)."""
    metadata.setdefault("hf_layout", HF_AS_IS)
    param = make_param(nnx.Rngs(0), shape, dtype, spec, init="zeros")
    for key, value in metadata.items():
        param.set_metadata(key, value)
    return param


def _sharding_like(reference: jax.Array, spec: Sequence[str | None]):
    sharding = reference.sharding
    if isinstance(sharding, NamedSharding):
        axes = set(sharding.mesh.axis_names)
        return NamedSharding(sharding.mesh, PartitionSpec(*(a if a in axes else None for a in spec)))
    return sharding


def replace_params(layer: nnx.Module, compute: Callable[..., tuple[jax.Array, ...]], inputs: Sequence[str],
                   outputs: dict[str, tuple[Any, Sequence[str | None]]]) -> None:
    """Set ``layer``'s ``outputs`` (name -> (dtype, spec)) to ``compute(*inputs)``, one compiled
    program on the devices of the first input, each result on its own sharding."""
    reference = getattr(layer, inputs[0]).get_value()
    shardings = tuple(_sharding_like(reference, spec) for _, spec in outputs.values())
    values = jax.jit(compute, out_shardings=shardings)(*(getattr(layer, n)[...] for n in inputs))
    for (name, (dtype, spec)), value in zip(outputs.items(), values):
        param = nnx.Param(value.astype(dtype), out_sharding=tuple(spec), eager_sharding=False, hf_layout=HF_AS_IS)
        setattr(layer, name, param)


def model_weight_bytes(model: nnx.Module) -> int:
    """Bytes of every Param the model holds (all devices' shards together, replicas counted once)."""
    total = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            value = node.get_value()
            total += int(np.prod(value.shape)) * jnp.dtype(value.dtype).itemsize
    return total
