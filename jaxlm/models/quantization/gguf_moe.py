"""GGUF MoE experts kept in llama.cpp's blocks (vLLM's ``GGUFMoEMethod``).

A GGUF file stacks each layer's experts per projection (``blk.N.ffn_{gate,up,down}_exps``), each
of its own block type (Q4_K_M files write down in Q6_K, and layers may differ), so the method
keeps one stacked Param a projection, each the file's bytes per expert slot:

- ``gate_qweight`` / ``up_qweight`` [S, I rows, H / block values * block bytes] uint8,
- ``down_qweight`` [S, H rows, I / block values * block bytes] uint8,

in the C++ kernel's layout with cpu_kernel (kernels_cpu/gguf_matmul.py: to_kernel_layout; the
same bytes, put in that layout on the host as each expert streams in), the file's layout
otherwise. No float copy of an expert is held.

The product: on CPU the tile loop (moe_ops) multiplies each tile's rows by its expert's blocks,
sliced out of the stack, through the C++ kernel (``gguf_product``: x rounded to int8 per block of
32, as llama.cpp does); XLA:CPU dequantizing blocks each step streams ~5x float's bytes
(docs/PERF_NOTES.md, session 9). Off CPU (no C++ kernel) ragged_dot runs on every local expert
dequantized in XLA inside the step.

Sharding: by expert slot under expert parallel; under tensor parallel gate/up by output rows and
down by input columns, only where the kernel layout splits into pieces that are each the layout
of the piece (whole interleaved row groups, whole blocks: checked on a probe, so no layout is
assumed), else refused naming the layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.moe_ops import Dequant, TileProducts, grouped_mlp
from jaxlm.models.quantization.base_config import FusedMoEMethodBase
from jaxlm.models.quantization.gguf_product import gguf_product
from jaxlm.models.quantization.params import zeros_param
from jaxlm.models.quantization.unquantized import expert_specs
from jaxlm.models.utils import WeightTarget
from kernels_cpu.gguf_matmul import GGUF_KERNEL_TYPES, from_kernel_layout, gguf_dequantize_rows, to_kernel_layout

# HF projection -> this method's Param (the order of ``weights``).
PROJECTIONS = (("gate_proj", "gate_qweight"), ("up_proj", "up_qweight"), ("down_proj", "down_qweight"))


def _row_bytes(k: int, qtype: int) -> int:
    bt = GGUF_KERNEL_TYPES[qtype]
    return k // bt.block_size * bt.type_size


@functools.lru_cache(maxsize=None)
def kernel_layout_shape(rows: int, k: int, qtype: int) -> tuple[int, int]:
    """The shape of an [rows, k]-value tensor's blocks in the kernel layout (asked of
    to_kernel_layout itself, so a type's layout lives in one place)."""
    return tuple(to_kernel_layout(np.zeros((rows, _row_bytes(k, qtype)), np.uint8), qtype).shape)


@functools.lru_cache(maxsize=None)
def layout_splits(rows: int, k: int, qtype: int, parts: int, axis: int) -> bool:
    """Whether the kernel layout of [rows, k] values splits into ``parts`` equal pieces along
    ``axis`` (0: rows, 1: columns) that are each the kernel layout of the matching piece of the
    file's blocks (a probe of random bytes)."""
    blocks = _row_bytes(k, qtype) // GGUF_KERNEL_TYPES[qtype].type_size
    if (rows if axis == 0 else blocks) % parts:
        return False
    probe = np.random.default_rng(0).integers(0, 256, (rows, _row_bytes(k, qtype)), dtype=np.uint8)
    whole = to_kernel_layout(probe, qtype)
    if whole.shape[axis] % parts:
        return False
    pieces = [to_kernel_layout(np.ascontiguousarray(p), qtype) for p in np.split(probe, parts, axis=axis)]
    return all(np.array_equal(a, b) for a, b in zip(np.split(whole, parts, axis=axis), pieces))


def _dense(q: jax.Array, qtype: int, n: int, cpu_kernel: bool) -> jax.Array:
    """One expert's blocks of an [n, K] weight -> its values [n, K] f32, in XLA."""
    return gguf_dequantize_rows(from_kernel_layout(q, qtype, n) if cpu_kernel else q, qtype)


@dataclasses.dataclass(frozen=True)
class GGUFMoEMethod(FusedMoEMethodBase):
    """``qtypes``: the GGML types of gate, up and down (each a kernel type); ``cpu_kernel``: the
    blocks are in the C++ kernel's layout and the tile products are that kernel."""

    qtypes: tuple[int, int, int]
    cpu_kernel: bool = True
    param_names = tuple(name for _, name in PROJECTIONS)

    def _shape(self, rows: int, k: int, qtype: int) -> tuple[int, int]:
        return kernel_layout_shape(rows, k, qtype) if self.cpu_kernel else (rows, _row_bytes(k, qtype))

    def _check_split(self, layer: nnx.Module) -> None:
        """Tensor parallel: gate/up split by rows and down by input columns, each device's piece
        being whole blocks (and whole row groups of the kernel layout), or a clear refusal."""
        tp, H, I = layer.tp_size, layer.hidden_size, layer.intermediate_size
        if tp == 1:
            return
        gate_t, up_t, down_t = self.qtypes
        if self.cpu_kernel:
            ok = (layout_splits(I, H, gate_t, tp, 0) and layout_splits(I, H, up_t, tp, 0)
                  and layout_splits(H, I, down_t, tp, 1))
        else:  # the file's layout: any rows; down's columns in whole blocks
            ok = (I // GGUF_KERNEL_TYPES[down_t].block_size) % tp == 0
        if not ok:
            names = "/".join(GGUF_KERNEL_TYPES[t].name for t in self.qtypes)
            raise ValueError(
                f"GGUFMoEMethod: tensor_parallel_size={tp} does not split the experts' blocks (gate/up/down "
                f"{names}, intermediate size {I}) into whole blocks and kernel row groups per device; "
                "try --enable-expert-parallel")

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        self._check_split(layer)
        S, H, I = layer.num_slots, layer.hidden_size, layer.intermediate_size
        ep, tp = expert_specs(layer)
        gate_t, up_t, down_t = self.qtypes
        layer.gate_qweight = zeros_param((S, *self._shape(I, H, gate_t)), jnp.uint8, (ep, tp, None))
        layer.up_qweight = zeros_param((S, *self._shape(I, H, up_t)), jnp.uint8, (ep, tp, None))
        layer.down_qweight = zeros_param((S, *self._shape(H, I, down_t)), jnp.uint8, (ep, None, tp))

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        """Each expert's ``{prefix}.{e}.{proj}.weight`` as the loader yields it in blocks
        ([out, row bytes], model_loader/gguf_utils.py), into its slot (padding slots stay zero)."""
        H, I = layer.hidden_size, layer.intermediate_size
        targets = {}
        for (proj, name), qtype in zip(PROJECTIONS, self.qtypes):
            rows, k = (H, I) if proj == "down_proj" else (I, H)
            if self.cpu_kernel:
                fn = functools.partial(lambda a, t: to_kernel_layout(a, t)[None], t=qtype)
            else:
                fn = lambda a: np.asarray(a, np.uint8)[None]  # noqa: E731
            param = getattr(layer, name)
            for e, slot in enumerate(layer.slots):
                targets[f"{prefix}.{e}.{proj}.weight"] = WeightTarget(
                    (rows, _row_bytes(k, qtype)), [(param, fn)], starts=(slot, 0, 0))
        return targets

    def _sizes(self, layer: nnx.Module) -> tuple[int, int]:
        """(hidden, this device's intermediate size)."""
        return layer.hidden_size, layer.intermediate_size // layer.tp_size

    def tile_products(self, layer: nnx.Module) -> TileProducts:
        """One tile's products: each projection's blocks through gguf_product (the C++ kernel
        with cpu_kernel, XLA dequantizing them without)."""

        (gate_t, up_t, down_t), (H, i_local), ck = self.qtypes, self._sizes(layer), self.cpu_kernel

        def gate_up(x: jax.Array, parts: tuple[jax.Array, ...]) -> jax.Array:
            g, u = parts
            return jnp.concatenate([gguf_product(x, g, gate_t, i_local, ck),
                                    gguf_product(x, u, up_t, i_local, ck)], axis=-1).astype(x.dtype)

        def down(h: jax.Array, parts: tuple[jax.Array, ...]) -> jax.Array:
            return gguf_product(h, parts[0], down_t, H, ck).astype(h.dtype)

        return TileProducts(gate_up, down)

    def dequants(self, layer: nnx.Module) -> tuple[Dequant, Dequant]:
        """For ragged_dot (off CPU): one expert's weight [K, N] in the activations' dtype, per side."""
        (gate_t, up_t, down_t), (H, i_local), ck = self.qtypes, self._sizes(layer), self.cpu_kernel

        def gate_up(parts: tuple[jax.Array, ...], dtype: Any) -> tuple[jax.Array, None]:
            g, u = parts
            w = jnp.concatenate([_dense(g, gate_t, i_local, ck).T, _dense(u, up_t, i_local, ck).T], axis=1)
            return w.astype(dtype), None

        def down(parts: tuple[jax.Array, ...], dtype: Any) -> tuple[jax.Array, None]:
            return _dense(parts[0], down_t, H, ck).T.astype(dtype), None

        return gate_up, down

    def apply(self, layer: nnx.Module, weights: tuple[jax.Array, ...], xs: jax.Array, expert_ids: jax.Array,
              first_expert: jax.Array, act: Any) -> jax.Array:
        gate, up, down = weights
        return grouped_mlp(xs, expert_ids, (gate, up), (down,), first_expert, act, dequant=self.dequants(layer),
                           products=self.tile_products(layer))
