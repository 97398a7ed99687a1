"""GGUF experts' grouped product (``GGUFMoEMethod.apply``) against every expert on every token
(numpy, float64) on the dequantized weights, gate, up and down each of its own type (Q4_K /
Q6_K / Q5_K and Q8_0 / Q4_1 / Q4_0), over two expert shards:

- the file's layout dequantized in XLA (accelerators; here on CPU through the tiles and through
  ragged_dot): within 2e-5 of max|out| (the same f32 weights);
- the C++ kernel per tile (kernel layout): within 2e-5 of the same reference fed the int8
  rounding of the kernel (x of each product rounded per block of 32), and 1-3% off the
  unrounded one (so the rounding reference is the one that holds it);
- ``jax.export(..., platforms=['cuda'])``: ragged_dot on bf16 operands, the uint8 blocks entering
  the step as stored, no call of the CPU kernel.
"""

from __future__ import annotations

import functools
import types

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.attention.backends import cpu_kernels_unavailable
from jaxlm.models.moe_ops import combine, grouped_mlp_ragged, route, sort_by_expert
from jaxlm.models.quantization.gguf_moe import GGUFMoEMethod, kernel_layout_shape, layout_splits
from kernels_cpu.gguf_matmul import dequantize_reference, quantize_rows_reference, to_kernel_layout
from tests.helpers import kquants

_Q = gguf.GGMLQuantizationType
E, K, T, H, I = 6, 2, 11, 256, 256
MIXES = {"K-quants": (_Q.Q4_K, _Q.Q6_K, _Q.Q5_K), "32-value": (_Q.Q8_0, _Q.Q4_1, _Q.Q4_0)}


def _layer(tp: int = 1):
    return types.SimpleNamespace(hidden_size=H, intermediate_size=I, tp_size=tp)


def _experts(rng, qtypes):
    """Per projection: the file's blocks [E, rows, row bytes] and their values [E, rows, k]."""
    out = []
    for qtype, (rows, k) in zip(qtypes, ((I, H), (I, H), (H, I))):
        w = (0.3 * rng.normal(size=(E, rows, k))).astype(np.float32)
        blocks = np.stack([kquants.quantize(w[e], qtype) for e in range(E)])
        values = np.stack([dequantize_reference(blocks[e], int(qtype), k) for e in range(E)])
        out.append((blocks, values))
    return out


def _reference(x, ids, weights, values, round_x: bool):
    """Every expert on every token (float64), x of each product rounded as the kernel rounds it."""
    (_, g), (_, u), (_, d) = values
    rnd = quantize_rows_reference if round_x else (lambda a: a)
    xr = rnd(x).astype(np.float64)
    gate, up = np.einsum("th,eih->eti", xr, g), np.einsum("th,eih->eti", xr, u)
    h = gate / (1 + np.exp(-gate)) * up
    y = np.stack([rnd(h[e].astype(np.float32)).astype(np.float64) @ d[e].T for e in range(E)])
    return np.stack([sum(weights[t, j] * y[ids[t, j], t] for j in range(ids.shape[1])) for t in range(T)])


def _run(method, x, ids, weights, stacks, impl=None):
    half = E // 2

    @jax.jit
    def moe(x, ids, weights, *stacks):
        order, es = sort_by_expert(ids)
        xs = x[order // K]
        ys = 0
        for s in range(2):  # two expert shards, each with its experts' blocks
            local = tuple(a[s * half:(s + 1) * half] for a in stacks)
            if impl is None:
                ys = ys + method.apply(_layer(), local, xs, es, jnp.int32(s * half), jax.nn.silu)
            else:  # the accelerators' branch, forced on CPU
                ys = ys + impl(xs, es, local[:2], local[2:], jnp.int32(s * half), jax.nn.silu)
        return combine(ys, order, weights)

    return np.asarray(moe(x, ids, weights, *stacks))


@pytest.mark.parametrize("mix", list(MIXES))
def test_file_layout_dequantized_in_xla_matches_the_dequantized_weights(mix):
    rng = np.random.default_rng(1)
    qtypes = tuple(int(t) for t in MIXES[mix])
    values = _experts(rng, MIXES[mix])
    x = rng.normal(size=(T, H)).astype(np.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(T, E)) * 3, jnp.float32), K, True)
    ref = _reference(x, np.asarray(ids), np.asarray(weights, np.float64), values, round_x=False)
    method = GGUFMoEMethod(qtypes, cpu_kernel=False)
    stacks = tuple(jnp.asarray(b) for b, _ in values)
    # Tiles (CPU) with the dequantizing products, then ragged_dot with the method's dequant.
    tiles = _run(method, x, ids, weights, stacks)
    ragged = functools.partial(grouped_mlp_ragged, dequant=method.dequants(_layer()))
    scale = np.abs(ref).max()
    np.testing.assert_allclose(tiles, ref, atol=2e-5 * scale, rtol=0, err_msg="tiles")
    np.testing.assert_allclose(_run(method, x, ids, weights, stacks, ragged), ref, atol=2e-5 * scale, rtol=0,
                               err_msg="ragged_dot")


@pytest.mark.skipif(bool(cpu_kernels_unavailable()), reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("mix", list(MIXES))
def test_kernel_tiles_match_the_reference_that_rounds_x(mix):
    rng = np.random.default_rng(2)
    qtypes = tuple(int(t) for t in MIXES[mix])
    values = _experts(rng, MIXES[mix])
    x = rng.normal(size=(T, H)).astype(np.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(T, E)) * 3, jnp.float32), K, True)
    args = (x, np.asarray(ids), np.asarray(weights, np.float64), values)
    rounded, exact = _reference(*args, round_x=True), _reference(*args, round_x=False)
    stacks = tuple(jnp.asarray(np.stack([to_kernel_layout(b[e], t) for e in range(E)]))
                   for (b, _), t in zip(values, qtypes))
    got = _run(GGUFMoEMethod(qtypes, cpu_kernel=True), x, ids, weights, stacks)
    scale = np.abs(rounded).max()
    np.testing.assert_allclose(got, rounded, atol=2e-5 * scale, rtol=0)
    assert np.abs(got - exact).max() > 1e-3 * scale  # the rounding is real: the other reference misses


def test_tensor_parallel_splits_are_whole_blocks_and_row_groups():
    # Q8_0 rows interleave by 16 in the kernel layout: 64 rows split into 2 or 4 groups-whole pieces.
    assert layout_splits(64, 64, int(_Q.Q8_0), 2, 0) and layout_splits(64, 64, int(_Q.Q8_0), 4, 0)
    assert not layout_splits(48, 64, int(_Q.Q8_0), 2, 0)  # 24 rows a device: not whole groups of 16
    assert layout_splits(64, 64, int(_Q.Q8_0), 2, 1)  # 2 blocks of 32 columns: one each
    assert not layout_splits(64, 32, int(_Q.Q8_0), 2, 1)  # one block: no split
    assert not layout_splits(16, 256, int(_Q.Q4_K), 2, 1)  # one super-block of 256
    assert kernel_layout_shape(64, 64, int(_Q.Q8_0))[0] * kernel_layout_shape(64, 64, int(_Q.Q8_0))[1] == 64 * 2 * 34
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not split the experts' blocks .*"
                                         r"--enable-expert-parallel"):
        GGUFMoEMethod((int(_Q.Q8_0),) * 3)._check_split(types.SimpleNamespace(hidden_size=64, intermediate_size=32,
                                                                               tp_size=2))


def test_cuda_lowering_is_ragged_dot_on_bf16_without_the_cpu_kernel():
    from jax import export

    qtypes = (int(_Q.Q4_K), int(_Q.Q4_1), int(_Q.Q6_K))
    method = GGUFMoEMethod(qtypes, cpu_kernel=False)
    stacks = tuple(jnp.zeros((E, *method._shape(r, k, t)), jnp.uint8)
                   for t, (r, k) in zip(qtypes, ((I, H), (I, H), (H, I))))
    xs, es = jnp.zeros((16, H), jnp.bfloat16), jnp.zeros((16,), jnp.int32)
    product = jax.jit(lambda xs, es, *w: method.apply(_layer(), w, xs, es, jnp.int32(0), jax.nn.silu))
    text = export.export(product, platforms=["cuda"])(xs, es, *stacks).mlir_module()
    assert "jaxlm_gguf_matmul" not in text
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "ui8" in main  # the blocks arrive as stored
    impls = [line for line in text.splitlines() if "func.func private @chlo.ragged_dot.impl" in line]
    assert impls
    for line in impls:
        operands = line.split("%arg0: ")[1].split("%arg2")[0]
        assert "bf16" in operands and "f32" not in operands, operands
    # on CPU the same method with the kernel layout lowers to the kernel's custom call
    cpu_method = GGUFMoEMethod(qtypes, cpu_kernel=True)
    kstacks = tuple(jnp.zeros((E, *cpu_method._shape(r, k, t)), jnp.uint8)
                    for t, (r, k) in zip(qtypes, ((I, H), (I, H), (H, I))))
    cpu = jax.jit(lambda xs, es, *w: cpu_method.apply(_layer(), w, xs, es, jnp.int32(0), jax.nn.silu)).lower(
        xs.astype(jnp.float32), es, *kstacks).as_text()
    assert "jaxlm_gguf_matmul" in cpu
