"""The quantized experts' grouped product on both paths (CPU tiles and ragged_dot, which GPUs
and TPUs run) and over two expert shards, against every expert computed on every token with
the dequantized weights (numpy, float64): fp8 with per-column scales (online quantization's
``quantize_experts``) and 4-bit words with group scales and zeros (``int_expert_weight``); and
the CUDA lowering of the fp8 experts (no GPU here: ``jax.export``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.models.moe_ops import (RaggedProducts, combine, grouped_mlp, grouped_mlp_ragged, grouped_mlp_tiled, route,
                                  sort_by_expert)
from jaxlm.models.quantization.fp8_moe import FP8_RAGGED, fp8_expert_weight, fp8_grouped_dot, quantize_experts
from jaxlm.models.quantization.fp8_utils import FP8_MAX
from jaxlm.models.quantization.int_weight import pack_rows
from jaxlm.models.quantization.int_weight_moe import int_expert_weight
from tests.models.test_moe_ops import _dense_reference

E, K, T, H, I, GROUP = 6, 2, 11, 16, 8, 8


def _fp8_case(rng):
    w_gu = (0.3 * rng.normal(size=(E, H, 2, I))).astype(np.float32)
    w_d = (0.3 * rng.normal(size=(E, I, H))).astype(np.float32)
    q_gu, s_gu, q_d, s_d = quantize_experts(jnp.asarray(w_gu), jnp.asarray(w_d))
    deq_gu = np.asarray(q_gu.astype(jnp.float32)) * np.asarray(s_gu)[:, None]
    deq_d = np.asarray(q_d.astype(jnp.float32)) * np.asarray(s_d)[:, None]
    # The columns' maxima land on +-448 and the rest within e4m3's relative step (2^-3).
    assert np.abs(np.abs(np.asarray(q_gu.astype(jnp.float32))).max(axis=1) - 448).max() == 0
    assert np.abs(deq_gu - w_gu).max() <= np.abs(w_gu).max() / 16
    return (q_gu, s_gu), (q_d, s_d), fp8_expert_weight, deq_gu, deq_d


def _int4(rng, rows: int, cols: tuple[int, ...]):
    """Random 4-bit values, group scales and zeros in the canonical layout, and their float weight."""
    q = rng.integers(0, 16, size=(E, rows) + cols)
    s = rng.uniform(0.01, 0.05, size=(E, rows // GROUP) + cols).astype(np.float32)
    z = rng.integers(0, 16, size=(E, rows // GROUP) + cols)
    deq = (q - np.repeat(z, GROUP, axis=1)) * np.repeat(s, GROUP, axis=1)
    flat = q.reshape(E, rows, -1)
    packed = np.stack([pack_rows(flat[e], 4) for e in range(E)]).reshape((E, rows // 8) + cols)
    return (jnp.asarray(packed), jnp.asarray(s), jnp.asarray(z.astype(np.int8))), deq


def _int_case(rng):
    gu, deq_gu = _int4(rng, H, (2, I))
    d, deq_d = _int4(rng, I, (H,))
    return gu, d, functools.partial(int_expert_weight, bits=4), deq_gu, deq_d


@pytest.mark.parametrize("case", [_fp8_case, _int_case], ids=["fp8", "int4"])
def test_quantized_grouped_mlp_matches_every_expert_on_the_dequantized_weights(case):
    rng = np.random.default_rng(3)
    gate_up, down, dequant, deq_gu, deq_d = case(rng)
    x = rng.normal(size=(T, H)).astype(np.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(T, E)) * 3, jnp.float32), K, True)
    ref = _dense_reference(x.astype(np.float64), np.asarray(ids), np.asarray(weights, np.float64),
                           deq_gu.astype(np.float64), deq_d.astype(np.float64))
    half = E // 2
    impls = {"ragged_dot": grouped_mlp_ragged, "tiles of 4": functools.partial(grouped_mlp_tiled, tile=4)}

    @functools.partial(jax.jit, static_argnums=0)
    def moe(impl, x, ids, weights, gate_up, down):
        order, es = sort_by_expert(ids)
        xs = x[order // K]
        # Two expert shards, each with its experts' blocks of every stored array.
        ys = sum(impl(xs, es, tuple(a[s * half:(s + 1) * half] for a in gate_up),
                      tuple(a[s * half:(s + 1) * half] for a in down), jnp.int32(s * half), jax.nn.silu,
                      dequant=dequant) for s in range(2))
        return combine(ys, order, weights)

    scale = np.abs(ref).max()
    for name, impl in impls.items():
        got = np.asarray(moe(impl, x, ids, weights, gate_up, down))
        np.testing.assert_allclose(got, ref, atol=2e-5 * scale, rtol=1e-5, err_msg=name)


def test_fp8_grouped_dot_math_matches_numpy():
    """The CUDA branch's grouped product, run on CPU (XLA:CPU executes e4m3 ragged_dot exactly):
    x quantized per tensor to e4m3, each row's expert's column scales on the output."""
    rng = np.random.default_rng(5)
    (q_gu, s_gu), _, _, _, _ = _fp8_case(rng)
    sizes = np.array([3, 0, 5, 1, 2, 0], np.int32)  # 11 rows, two experts with none
    row_expert = np.repeat(np.arange(E), sizes).astype(np.int32)
    x = rng.normal(size=(T, H)).astype(np.float32)
    ours = np.asarray(jax.jit(fp8_grouped_dot)(jnp.asarray(x), (q_gu, s_gu), jnp.asarray(sizes),
                                               jnp.asarray(row_expert)))
    x_scale = np.abs(x).max() / FP8_MAX
    x8 = np.clip(x / x_scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(np.float32)
    w = np.asarray(q_gu.astype(jnp.float32)).reshape(E, H, -1)
    s = np.asarray(s_gu).reshape(E, -1)
    ref = np.stack([(x8[r] @ w[e]) * x_scale * s[e] for r, e in enumerate(row_expert)])
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_fp8_grouped_mlp_on_cuda_math_is_close_to_the_dequantized_experts():
    """The whole grouped MLP with the fp8 grouped dot (both products' activations rounded to
    e4m3 per tensor) against the dequantized experts: within 10% of the largest output (seen
    7.2%: two roundings of the activations, each up to e4m3's 2^-4 step), where a wrong scale or
    expert would be off by the output's size."""
    rng = np.random.default_rng(3)
    gate_up, down, dequant, _, _ = _fp8_case(rng)
    x = jnp.asarray(rng.normal(size=(T, H)).astype(np.float32))
    weights, ids = route(jnp.asarray(rng.normal(size=(T, E)) * 3, jnp.float32), K, True)
    order, es = sort_by_expert(ids)
    xs = x[order // K]
    cuda_math = RaggedProducts(fp8_grouped_dot, fp8_grouped_dot)
    run = jax.jit(lambda ragged: grouped_mlp_ragged(xs, es, gate_up, down, jnp.int32(0), jax.nn.silu,
                                                    dequant=dequant, ragged=ragged), static_argnums=0)
    exact, ours = np.asarray(run(None)), np.asarray(run(cuda_math))
    err = np.abs(ours - exact).max() / np.abs(exact).max()
    assert 0 < err < 0.1, err


def test_cuda_lowering_is_an_fp8_ragged_dot():
    """``jax.export(..., platforms=['cuda'])``: the grouped products of fp8 experts lower to
    ragged_dot with e4m3 operands on both sides (the activations quantized in the step, the
    weights as they are stored), float32 accumulation; other platforms (TPU here) keep the
    weights converted to the activations' dtype."""
    from jax import export

    xs, es = jnp.zeros((16, H), jnp.bfloat16), jnp.zeros((16,), jnp.int32)
    gate_up = (jnp.zeros((E, H, 2, I), jnp.float8_e4m3fn), jnp.zeros((E, 2, I), jnp.float32))
    down = (jnp.zeros((E, I, H), jnp.float8_e4m3fn), jnp.zeros((E, H), jnp.float32))
    product = jax.jit(lambda xs, es, gu, d: grouped_mlp(xs, es, gu, d, jnp.int32(0), jax.nn.silu,
                                                        dequant=fp8_expert_weight, ragged=FP8_RAGGED))

    def ragged_operands(platform):
        text = export.export(product, platforms=[platform])(xs, es, gate_up, down).mlir_module()
        main = next(line for line in text.splitlines() if "func.func public @main" in line)
        assert "f8E4M3FN" in main  # the weights arrive in their bytes
        impls = [line for line in text.splitlines() if "func.func private @chlo.ragged_dot.impl" in line]
        assert len(impls) >= 2, platform  # gate/up and down
        return [line.split("%arg0: ")[1].split("%arg2")[0] for line in impls]

    for operands in ragged_operands("cuda"):
        assert operands.count("f8E4M3FN") == 2 and "bf16" not in operands, operands
    for operands in ragged_operands("tpu"):
        assert "bf16" in operands and "f8" not in operands, operands
