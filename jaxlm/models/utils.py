"""Params with sharding annotations, and placing checkpoint arrays onto them.

Every Param carries its PartitionSpec (over mesh axes ``data``/``model``) as flax nnx's
``out_sharding`` metadata from the moment it is created. ``eager_sharding=False`` keeps flax
from applying it at construction (there may be no mesh yet, and construction usually runs
under ``nnx.eval_shape``); the loader applies it when it places the real array.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Axis names of the mesh (vLLM: tensor parallel = "model").
DATA_AXIS = "data"
MODEL_AXIS = "model"
# Pipeline parallel: the leading axis of a ("stage", "data", "model") mesh, one sub-mesh per stage.
STAGE_AXIS = "stage"

# HF-layout transforms a Param may ask for when it is loaded (Param metadata ``hf_layout``).
HF_AS_IS = "as_is"
HF_TRANSPOSE = "transpose"  # torch nn.Linear [out, in] -> ours [in, out]


class WeightTarget:
    """Where one HF tensor goes: a list of (Param, HF array -> Param array), and its HF shape.

    ``starts``: the array is a block of each Param, written at these start indices (one
    expert of a stacked ``[E, ...]`` Param); None: it is the whole Param. ``alt_shapes``: other
    shapes the checkpoint may store it in (a scale as ``[]`` or ``[1]``)."""

    __slots__ = ("hf_shape", "parts", "starts", "alt_shapes")

    def __init__(self, hf_shape: tuple[int, ...], parts: list[tuple[nnx.Variable, Callable[[np.ndarray], np.ndarray]]],
                 starts: tuple[int, ...] | None = None, alt_shapes: tuple[tuple[int, ...], ...] = ()):
        self.hf_shape = tuple(hf_shape)
        self.parts = parts
        self.starts = starts
        self.alt_shapes = tuple(tuple(s) for s in alt_shapes)

    def accepts(self, shape: tuple[int, ...]) -> bool:
        return shape == self.hf_shape or shape in self.alt_shapes



def make_param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    dtype: jnp.dtype,
    sharding: Sequence[str | None],
    *,
    init: str = "normal",
    hf_layout: str = HF_AS_IS,
    kv_repeat: tuple[int, int] | None = None,
) -> nnx.Param:
    """A Param of ``shape`` annotated with ``sharding`` (one mesh axis name or None per dim).

    Random init (normal 0.02, ones, zeros) only matters for models used without a checkpoint;
    under ``nnx.eval_shape`` nothing is allocated. ``kv_repeat=(r, head_dim)``: the checkpoint
    holds 1/r of dim 0 (in HF layout) and each head of it is repeated r times on load (KV heads
    replicated under tensor parallel > num_kv_heads).
    """
    shape = tuple(int(s) for s in shape)
    if len(sharding) != len(shape):
        raise ValueError(f"sharding {sharding} does not match shape {shape}")
    if init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value, out_sharding=tuple(sharding), eager_sharding=False, hf_layout=hf_layout,
                     kv_repeat=kv_repeat)


def get_param_partition_spec(param: nnx.Variable) -> PartitionSpec:
    """The PartitionSpec a Param is annotated with (replicated when it has none)."""
    names = param.get_metadata().get("out_sharding")
    if names is None:
        return PartitionSpec()
    if isinstance(names, PartitionSpec):
        return names
    return PartitionSpec(*names)


def param_sharding(param: nnx.Variable, mesh: Mesh | None) -> jax.sharding.Sharding | None:
    """NamedSharding on ``mesh`` (axes the mesh lacks become replicated); None = default device."""
    if mesh is None:
        return None
    spec = get_param_partition_spec(param)
    axes = set(mesh.axis_names)

    def keep(entry):
        if entry is None:
            return None
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a in axes)
            return kept or None
        return entry if entry in axes else None

    return NamedSharding(mesh, PartitionSpec(*(keep(e) for e in spec)))


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """The ("data", "model") sub-mesh of pipeline stage ``stage`` (a mesh without stages: itself)."""
    if STAGE_AXIS not in mesh.axis_names:
        return mesh
    if mesh.axis_names[0] != STAGE_AXIS:
        raise ValueError(f"the {STAGE_AXIS!r} axis must lead the mesh, got axes {mesh.axis_names}")
    return Mesh(mesh.devices[stage], mesh.axis_names[1:])


def hf_shape(param: nnx.Variable) -> tuple[int, ...]:
    """Shape the HF checkpoint stores this Param in."""
    shape = tuple(param.get_value().shape)
    if param.get_metadata().get("hf_layout") == HF_TRANSPOSE:
        shape = shape[::-1]
    repeat = param.get_metadata().get("kv_repeat")
    if repeat is not None:
        shape = (shape[0] // repeat[0],) + shape[1:]
    pad = param.get_metadata().get("hf_pad_rows")
    if pad:
        shape = (shape[0] - pad,) + shape[1:]
    return shape


def to_param_layout(param: nnx.Variable, array: np.ndarray) -> np.ndarray:
    """HF array -> the Param's own layout."""
    repeat = param.get_metadata().get("kv_repeat")
    if repeat is not None:
        r, head_dim = repeat
        heads = array.shape[0] // head_dim
        array = np.repeat(array.reshape(heads, head_dim, *array.shape[1:]), r, axis=0)
        array = array.reshape(heads * r * head_dim, *array.shape[2:])
    pad = param.get_metadata().get("hf_pad_rows")
    if pad:  # vocabulary rows padded for an even tensor-parallel split: zeros, sliced off the logits
        array = np.concatenate([array, np.zeros((pad, *array.shape[1:]), array.dtype)])
    if param.get_metadata().get("hf_layout") == HF_TRANSPOSE:
        return np.ascontiguousarray(array.T)
    return array


def unsplittable(param: nnx.Variable, mesh: Mesh | None) -> str | None:
    """Why the Param cannot be split over ``mesh`` as its PartitionSpec asks (None: it can): a
    dimension that is not a multiple of the devices it is split over."""
    sharding = param_sharding(param, mesh)
    if sharding is None:
        return None
    shape = tuple(param.get_value().shape)
    for dim, entry in enumerate(sharding.spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        n = math.prod(mesh.shape[a] for a in axes)
        if n > 1 and shape[dim] % n:
            return f"its {shape} weight splits dimension {dim} ({shape[dim]}) over {n} devices"
    return None


def is_tensor_parallel_layout(param: nnx.Variable) -> bool:
    """Whether this Param holds more than the checkpoint does (KV heads repeated, vocab rows padded)."""
    md = param.get_metadata()
    return md.get("kv_repeat") is not None or bool(md.get("hf_pad_rows"))


def to_hf_layout(param: nnx.Variable, array: np.ndarray) -> np.ndarray:
    """The Param's own layout -> HF's (the inverse of to_param_layout): repeats and padding dropped."""
    md = param.get_metadata()
    if md.get("hf_layout") == HF_TRANSPOSE:
        array = array.T
    pad = md.get("hf_pad_rows")
    if pad:
        array = array[: array.shape[0] - pad]
    repeat = md.get("kv_repeat")
    if repeat is not None:
        r, head_dim = repeat
        heads = array.shape[0] // head_dim
        array = array.reshape(heads, head_dim, *array.shape[1:])[::r]
        array = array.reshape(heads // r * head_dim, *array.shape[2:])
    return np.ascontiguousarray(array)


def _as_dtype(array: np.ndarray, dtype: jnp.dtype) -> np.ndarray:
    host = np.asarray(array)
    if host.dtype != np.dtype(dtype):
        # ml_dtypes (bf16) casts through numpy; float32 is the CPU default.
        host = host.astype(dtype)
    return host


def place(param: nnx.Variable, array: np.ndarray, dtype: jnp.dtype, mesh: Mesh | None) -> None:
    """Convert one host array to ``dtype`` and put it straight onto the Param's sharding."""
    host = _as_dtype(array, dtype)
    sharding = param_sharding(param, mesh)
    value = jax.device_put(host, sharding) if sharding is not None else jax.device_put(host)
    param.set_value(value)


@functools.partial(jax.jit, donate_argnums=0)
def _write_block(value: jax.Array, block: jax.Array, starts: tuple[jax.Array, ...]) -> jax.Array:
    return jax.lax.dynamic_update_slice(value, block, starts)


def place_block(param: nnx.Variable, array: np.ndarray, starts: tuple[int, ...], dtype: jnp.dtype,
                mesh: Mesh | None) -> None:
    """Write one host block into the Param at ``starts`` (an expert of a stacked ``[E, ...]``
    Param), on the device, in place: the Param starts as zeros on its sharding, so host memory
    holds one checkpoint tensor at a time, never the stacked array."""
    host = _as_dtype(array, dtype)
    sharding = param_sharding(param, mesh)
    value = param.get_value()
    if isinstance(value, jax.ShapeDtypeStruct):
        value = jnp.zeros(value.shape, dtype, device=sharding)
    block_sharding = None
    if sharding is not None:
        # The block is split like the Param on the dims it spans whole; replicated on the others.
        spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
        block_sharding = NamedSharding(sharding.mesh, PartitionSpec(
            *(e if host.shape[i] == value.shape[i] else None for i, e in enumerate(spec))))
    block = jax.device_put(host, block_sharding) if block_sharding is not None else jax.device_put(host)
    out = _write_block(value, block, tuple(np.int32(s) for s in starts))
    if sharding is not None and out.sharding != sharding:
        out = jax.device_put(out, sharding)
    param.set_value(out)
