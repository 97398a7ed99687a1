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

from jaxlm.models.moe_ops import combine, grouped_mlp, grouped_mlp_ragged, grouped_mlp_tiled, route, sort_by_expert
from jaxlm.models.quantization.fp8_moe import fp8_expert_weight, quantize_experts
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


def test_cuda_lowering_is_ragged_dot_on_the_activations_dtype():
    """``jax.export(..., platforms=['cuda'])``: the grouped product of fp8 experts lowers to
    ragged_dot with bf16 operands, the e4m3 weights entering the step as they are stored."""
    from jax import export

    xs, es = jnp.zeros((16, H), jnp.bfloat16), jnp.zeros((16,), jnp.int32)
    gate_up = (jnp.zeros((E, H, 2, I), jnp.float8_e4m3fn), jnp.zeros((E, 2, I), jnp.float32))
    down = (jnp.zeros((E, I, H), jnp.float8_e4m3fn), jnp.zeros((E, H), jnp.float32))
    product = jax.jit(lambda xs, es, gu, d: grouped_mlp(xs, es, gu, d, jnp.int32(0), jax.nn.silu,
                                                        dequant=fp8_expert_weight))
    text = export.export(product, platforms=["cuda"])(xs, es, gate_up, down).mlir_module()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "f8E4M3FN" in main  # the weights arrive in their bytes
    impls = [line for line in text.splitlines() if "func.func private @chlo.ragged_dot.impl" in line]
    assert len(impls) >= 1
    for line in impls:
        operands = line.split("%arg0: ")[1].split("%arg2")[0]
        assert "bf16" in operands and "f8" not in operands and "f32" not in operands, operands
