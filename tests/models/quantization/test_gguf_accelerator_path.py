"""GGUF blocks off XLA:CPU: kept in their bytes, each product dequantizing them in XLA.

On an accelerator the C++ kernels do not exist, so ``block_plan`` keeps every kernel type in
blocks with ``cpu_kernels`` off and ``gguf_product`` dequantizes inside the step (XLA fuses the
convert into the dot there). Without a GPU here the branch runs on CPU: it must equal the gguf
package's dequantizer followed by a float64 product (f32 x: within 1e-5 of max|out|; bf16 x, the
accelerators' dtype: within 2% of max|out|, bf16's 8-bit mantissa on x and W), and a whole model
planned that way must give the dequantized model's logits (within 1e-5 of their range: the same
f32 weights, only the order of XLA's sums differs: tests/model_loader/test_gguf_blocks.py).
``jax.export(..., platforms=['cuda'])``
lowers the branch for CUDA: a dot on bf16 operands and no call of the CPU kernel.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxlm.models.quantization.gguf import block_plan
from jaxlm.models.quantization.gguf_product import gguf_product
from kernels_cpu.gguf_matmul import GGUF_KERNEL_TYPES, gguf_matmul_reference, to_kernel_layout
from tests.helpers import kquants

_Q = gguf.GGMLQuantizationType


def test_block_plan_per_platform():
    every = frozenset(GGUF_KERNEL_TYPES)
    assert block_plan("cpu", None) == (every, True)
    assert block_plan("cpu", "no C++ compiler") == (frozenset(), False)  # dequantized at load
    assert block_plan("gpu", None) == (every, False)
    assert block_plan("tpu", None) == (every, False)


def _blocks(rng, qtype: int, n: int, k: int) -> np.ndarray:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    return kquants.quantize(w, _Q(qtype))


@pytest.mark.parametrize("qtype", sorted(GGUF_KERNEL_TYPES), ids=[t.name for _, t in sorted(GGUF_KERNEL_TYPES.items())])
def test_xla_branch_matches_the_dequantizer(qtype):
    rng = np.random.default_rng(qtype)
    m, n, k = 5, 40, 512
    w = _blocks(rng, qtype, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = gguf_matmul_reference(x, w, qtype)
    scale = np.abs(ref).max()
    product = jax.jit(gguf_product, static_argnums=(2, 3, 4))
    out = np.asarray(product(jnp.asarray(x), jnp.asarray(w), qtype, n, False))
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * scale)
    half = np.asarray(product(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), qtype, n, False))
    assert half.dtype == np.float32
    np.testing.assert_allclose(half, ref, rtol=0, atol=0.02 * scale)


@pytest.mark.parametrize("qtype", [_Q.Q4_1, _Q.Q4_K], ids=["Q4_1", "Q4_K"])
def test_cuda_lowering_is_a_bf16_dot_without_the_cpu_kernel(qtype):
    rng = np.random.default_rng(0)
    w = jnp.asarray(_blocks(rng, int(qtype), 64, 256))
    x = jnp.zeros((8, 256), jnp.bfloat16)
    text = export.export(jax.jit(lambda x, w: gguf_product(x, w, int(qtype), 64, False)),
                         platforms=["cuda"])(x, w).mlir_module()
    assert "jaxlm_gguf_matmul" not in text
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and all("bf16" in line for line in dots), dots
    # the CPU branch, lowered for CPU, is the kernel's custom call (what CUDA must not get)
    wk = jnp.asarray(to_kernel_layout(np.asarray(w), int(qtype)))  # the kernel's layout (Q4_1: interleaved)
    cpu = jax.jit(lambda x, w: gguf_product(x, w, int(qtype), 64, True)).lower(x, wk).as_text()
    assert "jaxlm_gguf_matmul" in cpu
