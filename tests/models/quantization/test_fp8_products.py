"""The fp8 products against NumPy references, and the CUDA path's lowering without a GPU.

``fp8_linear`` picks XLA's fp8 dot on CUDA (both operands e4m3, float32 accumulation) and the
weight dequantized inside the product elsewhere. ``jax.export(..., platforms=['cuda'])`` lowers
the CUDA branch on this CPU machine: the exported module must hold a dot whose operands are
f8E4M3FN (the fp8 tensor-core product), not a dot on converted floats.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from jaxlm.models.quantization.fp8_utils import (
    FP8_MAX, dequant_matmul, fp8_linear, fp8_matmul, quantize_per_channel)

E4M3 = ml_dtypes.float8_e4m3fn


def _weights(rng, k, n):
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.1
    q, s = quantize_per_channel(jnp.asarray(w))
    return w, np.asarray(q), np.asarray(s)


@pytest.mark.parametrize("t,k,n", [(1, 64, 96), (7, 128, 40), (33, 96, 256)])
def test_per_channel_quantization_and_cpu_product_match_numpy(t, k, n):
    rng = np.random.default_rng(t)
    w, q, s = _weights(rng, k, n)
    ref_s = np.abs(w).max(axis=0) / FP8_MAX
    np.testing.assert_allclose(s, ref_s, rtol=1e-6)
    ref_q = (w / ref_s).astype(E4M3)
    assert (q.astype(np.float32) == ref_q.astype(np.float32)).mean() > 0.999  # division rounding aside
    x = rng.standard_normal((t, k)).astype(np.float32)
    ours = np.asarray(jax.jit(fp8_linear)(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s)))
    ref = x @ (q.astype(np.float32) * s)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fp8_dot_math_matches_numpy(static):
    """The CUDA branch's math, run on CPU: x quantized per tensor to e4m3, both scales applied."""
    rng = np.random.default_rng(0)
    w, q, s = _weights(rng, 128, 64)
    x = rng.standard_normal((9, 128)).astype(np.float32)
    x_scale = np.float32(0.02) if static else np.abs(x).max() / FP8_MAX
    x8 = np.clip(x / x_scale, -FP8_MAX, FP8_MAX).astype(E4M3).astype(np.float32)
    ref = (x8 @ q.astype(np.float32)) * (x_scale * s)
    input_scale = jnp.asarray([x_scale]) if static else None
    ours = np.asarray(jax.jit(fp8_matmul)(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), input_scale))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    # Activation quantization costs accuracy against the dequantized-weight product (~e4m3's 2^-4).
    exact = np.asarray(dequant_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s)))
    assert np.abs(ours - exact).max() < 0.1 * np.abs(exact).max()


def _fp8_dots(text: str) -> list[str]:
    return [line for line in text.splitlines() if "dot_general" in line and re.search(r"f8E4M3FN.*f8E4M3FN", line)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cuda_path_lowers_to_an_fp8_dot(dtype, static):
    x = jax.ShapeDtypeStruct((64, 256), dtype)
    w = jax.ShapeDtypeStruct((256, 512), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((512,), jnp.float32)
    args = (x, w, s) + ((jax.ShapeDtypeStruct((1,), jnp.float32),) if static else ())
    cuda = export.export(jax.jit(fp8_linear), platforms=["cuda"])(*args).mlir_module()
    cpu = export.export(jax.jit(fp8_linear), platforms=["cpu"])(*args).mlir_module()
    assert _fp8_dots(cuda), cuda[-3000:]
    assert not _fp8_dots(cpu)  # CPU: the weight converted into the product instead
