"""fp8 (e4m3) helpers of the weight formats: per-channel quantization and the two products.

Kept here, apart from the fp8 KV cache's helpers, so the weight formats own their rounding rules
(vLLM's: scale = amax / 448, values clipped to +-448, float8_e4m3fn)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
TINY = 1e-12  # a column of zeros keeps a positive scale


def quantize_per_channel(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [in, out] float -> (e4m3 [in, out], float32 scale [out]) with w ~ q * scale."""
    wf = w.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=0), TINY) / FP8_MAX
    return jnp.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scale


def dequant_matmul(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x @ (w * scale): the e4m3 weight converted to x's dtype inside the product (exact: every
    e4m3 value is a bf16/f32 value), the per-column scale applied to the output."""
    y = jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def fp8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, input_scale: jax.Array | None = None) -> jax.Array:
    """x @ (w * scale) as XLA's fp8 dot (Hopper's fp8 tensor cores): x quantized to e4m3 with
    ``input_scale`` (static, from the checkpoint) or its own per-tensor amax (dynamic), both
    operands e4m3, float32 accumulation, both scales on the output."""
    x8, x_scale = quantize_activations(x, input_scale)
    y = jax.lax.dot_general(x8, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * (x_scale * scale.astype(jnp.float32))).astype(x.dtype)


def quantize_activations(x: jax.Array, input_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x -> (e4m3 x / x_scale, x_scale): ``input_scale`` (static) or x's own per-tensor amax (dynamic)."""
    xf = x.astype(jnp.float32)
    if input_scale is None:
        x_scale = jnp.maximum(jnp.max(jnp.abs(xf)), TINY) / FP8_MAX
    else:
        x_scale = input_scale.astype(jnp.float32).reshape(())
    return jnp.clip(xf / x_scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), x_scale


def fp8_linear(x: jax.Array, w: jax.Array, scale: jax.Array, input_scale: jax.Array | None = None) -> jax.Array:
    """The fp8 dot on CUDA; elsewhere (CPU has no fp8 units) the weight dequantized in the product."""
    return jax.lax.platform_dependent(
        x, w, scale,
        cuda=lambda x, w, s: fp8_matmul(x, w, s, input_scale),
        default=dequant_matmul)
