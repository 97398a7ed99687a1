"""The C++ GGUF block matmul (gguf_matmul.cc) as a JAX function, and its NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# GGML type id -> (name, bytes per block of 32 values): the types the kernel multiplies in place.
GGUF_KERNEL_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}
QK = 32


# From this many rows of x on, the kernel dequantizes tiles of W to f32 and multiplies in f32
# (prefill); below, it rounds x to int8 per block and takes integer dot products (decode).
F32_MIN_ROWS = 32


def gguf_matmul_cpu(x: jax.Array, w: jax.Array, qtype: int, *, f32_min_rows: int = F32_MIN_ROWS) -> jax.Array:
    """x [..., K] (cast to f32) @ W^T -> [..., N] f32, W [N, K] given as its GGUF blocks ``w``
    [N, K / 32 * block bytes] uint8 of type ``qtype`` (GGUF_KERNEL_TYPES). Fewer than
    ``f32_min_rows`` rows of x are rounded to int8 per block of 32 inside (as llama.cpp does);
    more are multiplied as given (0: always rounded). Needs load_cpu_kernels()."""
    if qtype not in GGUF_KERNEL_TYPES:
        raise ValueError(f"gguf_matmul_cpu: GGUF type {qtype} has no kernel (kernel types: "
                         f"{', '.join(n for n, _ in GGUF_KERNEL_TYPES.values())})")
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    if k % QK or w.shape[1] != k // QK * GGUF_KERNEL_TYPES[qtype][1]:
        raise ValueError(f"gguf_matmul_cpu: x [..., {k}] does not match {GGUF_KERNEL_TYPES[qtype][0]} "
                         f"blocks of shape {tuple(w.shape)}")
    x2 = x.reshape(-1, k).astype(jnp.float32)
    call = jax.ffi.ffi_call("jaxlm_gguf_matmul", jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x2, w, qtype=np.int32(qtype), f32_min_rows=np.int32(f32_min_rows)).reshape(*lead, n)


def gguf_dequantize_rows(rows: jax.Array, qtype: int) -> jax.Array:
    """Blocks [..., K / 32 * block bytes] uint8 -> values [..., K] f32, in XLA (any platform):
    the embedding's gathered rows. Same formulas as the C++ kernel (gguf_matmul.cc's header)."""
    name, size = GGUF_KERNEL_TYPES[qtype]
    lead = rows.shape[:-1]
    b = rows.reshape(*lead, -1, size)
    f16 = lambda lo: jax.lax.bitcast_convert_type(b[..., lo:lo + 2], jnp.float16).astype(jnp.float32)[..., None]  # noqa: E731
    if name == "Q8_0":
        vals = f16(0) * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    else:
        qs = b[..., size - QK // 2:]
        nib = jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.float32)
        vals = f16(0) * (nib - 8.0) if name == "Q4_0" else f16(0) * nib + f16(2)
    return vals.reshape(*lead, -1)


def dequantize_reference(w: np.ndarray, qtype: int, k: int) -> np.ndarray:
    """W [N, K] float32 from its blocks, by the ``gguf`` package's dequantizer."""
    import gguf

    return gguf.quants.dequantize(np.asarray(w, np.uint8), gguf.GGMLQuantizationType(qtype)).reshape(-1, k)


def quantize_rows_reference(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the kernel sees it: each block of 32 rounded to int8 times max|x| / 127."""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, QK)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.round(xb * inv) * d).reshape(x.shape).astype(np.float32)


def gguf_matmul_reference(x: np.ndarray, w: np.ndarray, qtype: int, *, quantize_x: bool = False) -> np.ndarray:
    """The NumPy oracle: dequantize W, then a float64 matmul. quantize_x: x rounded as the
    kernel rounds it first (isolates the kernel's arithmetic from the int8 activations)."""
    x = np.asarray(x, np.float32)
    if quantize_x:
        x = quantize_rows_reference(x)
    wf = dequantize_reference(w, qtype, x.shape[-1])
    return (x.astype(np.float64) @ wf.astype(np.float64).T).astype(np.float32)
