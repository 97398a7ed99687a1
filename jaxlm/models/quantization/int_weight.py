"""Integer weights with group scales (AWQ, GPTQ, compressed-tensors' pack-quantized WNA16).

Every such format is repacked at load, on the host one tensor at a time, into one layout:

- ``qweight`` int32 [in * bits / 32, out]: ``32 / bits`` values of consecutive input rows per
  word, row ``pf * k + j`` in bits ``bits * j`` (GPTQ's order), stored unsigned;
- ``scales`` [in / group, out] in the model dtype;
- ``qzeros`` int8 [in / group, out], unsigned, when the format has zero points (AWQ, GPTQ);
  symmetric formats (compressed-tensors) subtract ``2 ** (bits - 1)`` instead.

so one ``apply`` serves them all: the words are unpacked, offset and scaled by group inside
the compiled step, right before the product (a transient float weight per layer; no integer
kernel yet), and the device holds the packed bytes (4-bit: half a byte a weight plus 1/group of
scale and zero). All tensors are
[in, out]-major, so tensor parallel splits them like the float weight: output columns for a
column-parallel layer, input rows (whole groups) for a row-parallel one.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.quantization.base_config import LinearMethodBase
from jaxlm.models.quantization.params import zeros_param
from jaxlm.models.utils import WeightTarget

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds column order[i]


def unpack_columns(packed: np.ndarray, bits: int, order: tuple[int, ...]) -> np.ndarray:
    """int32 [R, C / pf] packed along columns -> uint8 [R, C]; value at column pf*k + order[i]
    is in bits ``bits * i`` of word k."""
    pf = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    out = np.empty((words.shape[0], words.shape[1], pf), np.uint8)
    for i in range(pf):
        out[:, :, order[i]] = (words >> np.uint32(bits * i)) & np.uint32((1 << bits) - 1)
    return out.reshape(words.shape[0], -1)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """uint [R, C] -> int32 [R / pf, C], row pf*k + j in bits ``bits * j`` of word k."""
    pf = 32 // bits
    v = values.astype(np.uint32).reshape(values.shape[0] // pf, pf, values.shape[1])
    words = np.zeros((v.shape[0], v.shape[2]), np.uint32)
    for j in range(pf):
        words |= v[:, j, :] << np.uint32(bits * j)
    return words.view(np.int32)


def dequantize(qweight: jax.Array, scales: jax.Array, zeros: jax.Array | None, bits: int, dtype) -> jax.Array:
    """The canonical layout -> float [in, out] in ``dtype`` (inside the compiled step)."""
    pf = 32 // bits
    rows, out = qweight.shape
    shifts = (jnp.arange(pf, dtype=jnp.int32) * bits)[None, :, None]
    q = (qweight[:, None, :] >> shifts) & ((1 << bits) - 1)  # [in/pf, pf, out]
    groups = scales.shape[0]
    q = q.reshape(groups, rows * pf // groups, out).astype(dtype)
    z = (zeros.astype(dtype) if zeros is not None else jnp.full((groups, out), 1 << (bits - 1), dtype))
    w = (q - z[:, None, :]) * scales.astype(dtype)[:, None, :]
    return w.reshape(rows * pf, out)


# One checkpoint tensor in a format: (HF shape, the canonical tensor it fills: "qweight",
# "scales", "qzeros", or None: read, not kept; HF array -> that tensor's [rows, out] layout).
HFTensor = tuple[tuple[int, ...], "str | None", Callable[[np.ndarray], np.ndarray]]


@dataclasses.dataclass(frozen=True)
class PackedIntLinearMethod(LinearMethodBase):
    """The shared layout and product; a format's subclass says how its tensors load
    (``hf_tensors``, which the stacked MoE experts use per expert too: int_weight_moe)."""

    bits: int = 4
    group_size: int = 128  # -1: one group over the whole input (per channel)
    has_zeros: bool = True

    @property
    def param_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("qweight", "scales") + (("qzeros",) if self.has_zeros else ())

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def group(self, layer: nnx.Module) -> int:
        return self.group_for(layer.in_features)

    def check_shape(self, in_features: int, out_features: int) -> None:
        """A clear error for a product this layout cannot hold."""
        name = type(self).__name__
        g, pf = self.group_for(in_features), 32 // self.bits
        if in_features % g:
            raise ValueError(f"{name}: group_size {g} does not divide the layer's input dimension {in_features}")
        if in_features % pf or out_features % pf:
            raise ValueError(f"{name}: {self.bits}-bit packing needs in and out features divisible by {pf}, "
                             f"got {in_features} x {out_features}")

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        self.check_shape(layer.in_features, layer.out_features)
        if layer.kv_repeat is not None:
            raise ValueError(f"{type(self).__name__}: tensor parallel over more devices than KV heads repeats the "
                             "KV projections, which packed integer weights do not support yet")
        g, pf = self.group(layer), 32 // self.bits
        spec = layer.parallel.weight_spec
        # One group (per-channel scales): a row-parallel layer keeps it whole on every device.
        group_spec = spec if layer.in_features // g > 1 else (None, spec[1])
        layer.qweight = zeros_param((layer.in_features // pf, layer.out_features), jnp.int32, spec)
        layer.scales = zeros_param((layer.in_features // g, layer.out_features), layer.dtype, group_spec)
        if self.has_zeros:
            layer.qzeros = zeros_param((layer.in_features // g, layer.out_features), jnp.int8, group_spec)

    def hf_tensors(self, i: int, o: int, g: int) -> dict[str, HFTensor]:
        """The format's tensors of one [in=i, out=o] product with groups of g (subclasses)."""
        raise NotImplementedError

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        tensors = self.hf_tensors(layer.in_features, layer.out_features, self.group(layer))
        return {f"{prefix}.{suffix}": WeightTarget(shape, [] if name is None else [(getattr(layer, name), fn)])
                for suffix, (shape, name, fn) in tensors.items()}

    def apply(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
        zeros = layer.qzeros[...] if self.has_zeros else None
        w = dequantize(layer.qweight[...], layer.scales[...], zeros, self.bits, x.dtype)
        return x @ w


def _transposed(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T)


def _as_int8(a: np.ndarray) -> np.ndarray:
    return a.astype(np.int8)


@dataclasses.dataclass(frozen=True)
class AWQLinearMethod(PackedIntLinearMethod):
    """AutoAWQ GEMM: ``qweight`` [in, out/8] and ``qzeros`` [in/g, out/8] packed along the
    output in AWQ's nibble order, ``scales`` [in/g, out]; w = (q - z) * s."""

    def hf_tensors(self, i: int, o: int, g: int) -> dict[str, HFTensor]:
        pf, bits = 32 // self.bits, self.bits
        return {
            "qweight": ((i, o // pf), "qweight", lambda a: pack_rows(unpack_columns(a, bits, AWQ_ORDER), bits)),
            "qzeros": ((i // g, o // pf), "qzeros", lambda a: _as_int8(unpack_columns(a, bits, AWQ_ORDER))),
            "scales": ((i // g, o), "scales", np.asarray),
        }


@dataclasses.dataclass(frozen=True)
class GPTQLinearMethod(PackedIntLinearMethod):
    """GPTQ (AutoGPTQ's v1 checkpoint format): ``qweight`` [in/8, out] packed along the input,
    ``qzeros`` [in/g, out/8] packed along the output holding z - 1, ``scales`` [in/g, out] and
    ``g_idx`` [in] (the trivial i // g when ``desc_act`` is off: read, not kept)."""

    def hf_tensors(self, i: int, o: int, g: int) -> dict[str, HFTensor]:
        pf, bits = 32 // self.bits, self.bits
        return {
            "qweight": ((i // pf, o), "qweight", np.asarray),
            "qzeros": ((i // g, o // pf), "qzeros", lambda a: _as_int8(
                unpack_columns(a, bits, tuple(range(pf))).astype(np.int16) + 1)),
            "scales": ((i // g, o), "scales", np.asarray),
            "g_idx": ((i,), None, np.asarray),
        }


@dataclasses.dataclass(frozen=True)
class CompressedTensorsWNA16Method(PackedIntLinearMethod):
    """compressed-tensors ``pack-quantized`` symmetric weights: ``weight_packed`` [out, in/pf]
    packed along the input (values + 2**(bits-1)), ``weight_scale`` [out, in/g] ([out, 1] per
    channel), ``weight_shape`` [2] (read, not kept)."""

    has_zeros: bool = False

    def hf_tensors(self, i: int, o: int, g: int) -> dict[str, HFTensor]:
        pf = 32 // self.bits
        return {
            "weight_packed": ((o, i // pf), "qweight", _transposed),
            "weight_scale": ((o, i // g), "scales", _transposed),
            "weight_shape": ((2,), None, np.asarray),
        }
