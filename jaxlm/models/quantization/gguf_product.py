"""The product of activations with GGUF blocks (``gguf_product``): the C++ kernel on CPU below
F32_MIN_ROWS rows, XLA's dot on the dequantized blocks otherwise. Shared by the Linear and
embedding methods (gguf.py) and the MoE experts (gguf_moe.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels_cpu.gguf_matmul import F32_MIN_ROWS, from_kernel_layout, gguf_dequantize_rows, gguf_matmul_cpu


def gguf_product(x: jax.Array, qweight: jax.Array, qtype: int, n: int, cpu_kernel: bool = True) -> jax.Array:
    """x [..., K] @ W^T -> [..., n] f32, W in blocks (in the kernel layout with cpu_kernel). With
    the C++ kernels, below F32_MIN_ROWS rows: the kernel on int8 activations (as llama.cpp does at
    any batch), measured 1.1-10x faster than the branch below at 16-512 rows (docs/PERF_NOTES.md,
    session 12). From F32_MIN_ROWS, or without the kernels (an accelerator): XLA's dot on W
    dequantized in XLA, x as given (off CPU W in x's dtype, so a bf16 model's product stays a
    bf16 dot with the convert fused into it); the kernel's own f32 tiles measured 2-2.7x slower
    than XLA's dot at 512 rows (session 9)."""
    rows = math.prod(x.shape[:-1])
    if cpu_kernel and rows < F32_MIN_ROWS:
        return gguf_matmul_cpu(x, qweight, qtype, n=n, f32_min_rows=0)
    w = gguf_dequantize_rows(from_kernel_layout(qweight, qtype, n) if cpu_kernel else qweight, qtype)
    x = x.astype(jnp.float32) if cpu_kernel else x
    return jax.lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
