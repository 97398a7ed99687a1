"""GGUF weights kept in llama.cpp's blocks (vLLM's ``GGUFConfig``, ``--quantization gguf``).

A GGUF file's config carries ``quantization_config = {"quant_method": "gguf", "tensor_types":
{HF name: GGML type}}`` (model_loader/gguf_utils.py), so a .gguf model gets this config without
asking. Each ``Linear`` and the token ``Embedding`` whose tensor is Q8_0, Q4_0, Q4_1, Q4_K, Q5_K
or Q6_K holds the file's bytes as ``qweight`` [out, in / block values * block bytes] uint8 (3.8-7.1x
fewer bytes than float32, so a decode step streams that much less; for the C++ kernels the rows
are interleaved 16 at a time on the host as they load, about the same bytes in the kernel's
layout, kernels_cpu/gguf_matmul.py: to_kernel_layout) and multiplies through the C++
kernel (kernels_cpu/gguf_matmul.cc) inside the compiled step below F32_MIN_ROWS (1024) rows
(decode and prefill chunks of up to 512 tokens), or through XLA's dot on the weight dequantized
in XLA from there (``gguf_product``); the
embedding gathers its rows' blocks and dequantizes them in XLA, and a tied LM head goes through
the same product. A MoE layer's stacked experts whose gate, up and down are each a kernel type
stay in blocks too (``GGUFMoEMethod``, gguf_moe.py: each tile's expert through the C++ kernel).
Any other type (Q5_0,
Q2_K, F16, ...) has no kernel: the loader dequantizes it to float at load (one log line names
them; a layer's experts with any such projection are dequantized whole).
Without the C++ kernels on CPU (no compiler) every tensor is dequantized at load, as with
``--quantization none``; on an accelerator the blocks are kept and each product dequantizes them
in XLA (``block_plan``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.quantization.base_config import LinearMethodBase, QuantizationConfig, QuantizeMethodBase
from jaxlm.models.quantization.gguf_product import gguf_product
from jaxlm.models.utils import MODEL_AXIS, WeightTarget, make_param
from kernels_cpu.gguf_matmul import (GGUF_KERNEL_TYPES, gguf_dequantize_rows, kernel_layout_take, kernel_row_bytes,
                                     kernel_rows, to_kernel_layout)

logger = logging.getLogger(__name__)


def block_plan(platform: str, why_no_cpu_kernels: str | None) -> tuple[frozenset[int], bool]:
    """(the GGML types kept in blocks, whether their products are the C++ kernels) on
    ``platform``. XLA:CPU with the kernels built: every kernel type, through the kernels. Without
    them on CPU: none (XLA:CPU dequantizing every weight each step streams 5x float's bytes,
    docs/PERF_NOTES.md, session 9; dequantized at load instead). On an accelerator: every kernel
    type, each product dequantizing its blocks in XLA (a convert XLA fuses into the dot there)."""
    if platform != "cpu":
        return frozenset(GGUF_KERNEL_TYPES), False
    if why_no_cpu_kernels:
        return frozenset(), False
    return frozenset(GGUF_KERNEL_TYPES), True


@functools.lru_cache(maxsize=None)
def _block_plan_here() -> tuple[frozenset[int], bool]:
    """block_plan for this process (asked once)."""
    from jaxlm.attention.backends import cpu_kernels_unavailable

    platform = jax.default_backend()
    why = cpu_kernels_unavailable() if platform == "cpu" else None
    if why:
        logger.warning("GGUF: no C++ kernels here (%s): the weights are dequantized at load", why)
    elif platform != "cpu":
        logger.info("GGUF on %s: the blocks are kept, each product dequantizes them in XLA", platform)
    return block_plan(platform, why)


def _row_bytes(k: int, qtype: int) -> int:
    bt = GGUF_KERNEL_TYPES[qtype]
    return k // bt.block_size * bt.type_size


def _blocks_param(rngs: nnx.Rngs, rows: int, k: int, qtype: int, spec: tuple[str | None, ...],
                  kernel_layout: bool) -> nnx.Param:
    """The blocks as the file has them ([rows, row bytes]), or in the C++ kernel's layout (rows
    interleaved by 16: kernels_cpu/gguf_matmul.py, to_kernel_layout)."""
    shape = ((kernel_rows(rows, qtype), kernel_row_bytes(k, qtype)) if kernel_layout
             else (rows, _row_bytes(k, qtype)))
    return make_param(rngs, shape, jnp.uint8, spec, init="zeros")


def _check_whole_blocks(name: str, k: int, qtype: int) -> None:
    """A tensor's rows must be whole blocks (llama.cpp writes no other: its quantizer picks
    another type for such a tensor), so a row that is not names the file as broken."""
    bt = GGUF_KERNEL_TYPES[qtype]
    if k % bt.block_size:
        raise ValueError(f"GGUF tensor {name} is {bt.name}, whose blocks hold {bt.block_size} values, but the "
                         f"model's input dimension there is {k}, not a multiple of {bt.block_size} (a corrupt "
                         "file, or a config that does not match it)")


def _blocks_target(layer: nnx.Module, prefix: str, rows: int, k: int, qtype: int,
                   kernel_layout: bool) -> dict[str, WeightTarget]:
    """The checkpoint's ``{prefix}.weight``, as the loader yields it in blocks, into ``qweight``
    (put in the kernel's layout on the host as it streams in)."""
    q = layer.qweight
    fn = (lambda a: to_kernel_layout(a, qtype)) if kernel_layout else (lambda a: a)
    return {f"{prefix}.weight": WeightTarget((rows, _row_bytes(k, qtype)), [(q, fn)])}


@dataclasses.dataclass(frozen=True)
class GGUFLinearMethod(LinearMethodBase):
    """``qweight`` [out, in / block values * block bytes] uint8 of GGML type ``qtype`` (in the
    kernel layout with cpu_kernel: [ceil(out / 16), 16 * kernel row bytes]); the product
    is the C++ kernel (rows of x rounded to int8 per block of 32 inside, as llama.cpp does)."""

    qtype: int
    cpu_kernel: bool = True
    param_names = ("qweight",)

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        if layer.kv_repeat is not None:
            raise ValueError("GGUF blocks cannot repeat KV heads (tensor parallel > KV heads): "
                             "use --quantization none")
        spec = (layer.parallel.weight_spec[1], layer.parallel.weight_spec[0])  # [out, in]
        layer.qweight = _blocks_param(rngs, layer.out_features, layer.in_features, self.qtype, spec, self.cpu_kernel)

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        return _blocks_target(layer, prefix, layer.out_features, layer.in_features, self.qtype, self.cpu_kernel)

    def apply(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
        return gguf_product(x, layer.qweight[...], self.qtype, layer.out_features, self.cpu_kernel).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token embedding ``qweight`` [vocab, dim / block values * block bytes] uint8: a lookup gathers
    the rows' blocks and dequantizes them in XLA; the tied LM head is the C++ kernel."""

    qtype: int
    cpu_kernel: bool = True
    param_names = ("qweight",)

    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        spec = (MODEL_AXIS, None) if layer.shard_vocab else (None, None)
        layer.qweight = _blocks_param(rngs, layer.num, layer.dim, self.qtype, spec, self.cpu_kernel)

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        return _blocks_target(layer, prefix, layer.num, layer.dim, self.qtype, self.cpu_kernel)

    def embedding(self, layer: nnx.Module, ids: jax.Array) -> jax.Array:
        q = layer.qweight[...]
        rows = kernel_layout_take(q, ids, self.qtype) if self.cpu_kernel else jnp.take(q, ids, axis=0)
        return gguf_dequantize_rows(rows, self.qtype).astype(layer.dtype)

    def attend(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
        return gguf_product(x, layer.qweight[...], self.qtype, layer.num, self.cpu_kernel)


@dataclasses.dataclass(frozen=True)
class GGUFConfig(QuantizationConfig):
    """``tensor_types``: (HF tensor name, GGML type) of the file's tensors; ``kernel_types``: the
    types kept in blocks here (empty: everything dequantized); ``cpu_kernels``: their products are
    the C++ kernels (else XLA dequantizes the blocks inside each product: off XLA:CPU)."""

    tensor_types: tuple[tuple[str, int], ...] = ()
    kernel_types: frozenset[int] = frozenset()
    cpu_kernels: bool = True
    quantizes_embeddings = True

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        types = config.get("tensor_types") or {}
        kept, cpu_kernels = _block_plan_here()
        return cls(tuple(sorted((str(k), int(v)) for k, v in types.items())), kept, cpu_kernels)

    def get_quant_method(self, layer: nnx.Module, prefix: str) -> QuantizeMethodBase | None:
        from jaxlm.models.layers import Embedding, Linear
        from jaxlm.models.moe import FusedExperts

        if isinstance(layer, FusedExperts):
            return self._experts_method(layer, prefix)
        qtype = dict(self.tensor_types).get(f"{prefix}.weight")
        if qtype not in self.kernel_types:
            return None  # float: the loader dequantizes it
        if isinstance(layer, Linear) and layer.kv_repeat is None:
            _check_whole_blocks(f"{prefix}.weight", layer.in_features, qtype)
            return GGUFLinearMethod(qtype, self.cpu_kernels)
        if isinstance(layer, Embedding):
            _check_whole_blocks(f"{prefix}.weight", layer.dim, qtype)
            return GGUFEmbeddingMethod(qtype, self.cpu_kernels)
        return None

    def _experts_method(self, layer: nnx.Module, prefix: str) -> QuantizeMethodBase | None:
        """GGUFMoEMethod when gate, up and down are all kernel types (each its own); else None:
        the loader dequantizes the layer's experts at load (its one log line names them)."""
        from jaxlm.models.quantization.gguf_moe import PROJECTIONS, GGUFMoEMethod

        types = dict(self.tensor_types)
        qtypes = tuple(types.get(f"{prefix}.{proj}.weight") for proj, _ in PROJECTIONS)
        if not all(t in self.kernel_types for t in qtypes):
            return None
        for (proj, _), t in zip(PROJECTIONS, qtypes):
            k = layer.intermediate_size if proj == "down_proj" else layer.hidden_size
            _check_whole_blocks(f"{prefix}.{proj}.weight", k, t)
        return GGUFMoEMethod(qtypes, self.cpu_kernels)

    def describe(self) -> str:
        kept: dict[str, int] = {}
        for _, t in self.tensor_types:
            if t in self.kernel_types:
                kept[GGUF_KERNEL_TYPES[t].name] = kept.get(GGUF_KERNEL_TYPES[t].name, 0) + 1
        where = "" if self.cpu_kernels or not kept else ", dequantized in each product"
        return "gguf (" + (", ".join(f"{n} x{c}" for n, c in sorted(kept.items())) or "no tensors") + f" in blocks{where})"


def gguf_block_names(model: nnx.Module) -> frozenset[str]:
    """The checkpoint names ``model`` takes in GGUF blocks (the loader yields those undecoded)."""
    from jaxlm.models.quantization.model_quant import quantizable_layers

    from jaxlm.models.quantization.gguf_moe import PROJECTIONS, GGUFMoEMethod

    names = set()
    for prefix, layer in quantizable_layers(model):
        if isinstance(layer.quant_method, (GGUFLinearMethod, GGUFEmbeddingMethod)):
            names.add(f"{prefix}.weight")
        elif isinstance(layer.quant_method, GGUFMoEMethod):  # the stacked tensors' names (stacked_experts_key)
            names.update(f"{prefix}.{proj}.weight" for proj, _ in PROJECTIONS)
    return frozenset(names)
