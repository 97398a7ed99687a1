"""The C++ GGUF block matmul against the NumPy oracle (the gguf package's dequantizer, then a
float matmul), for each block type, 1-64 rows and odd shapes, on both of its paths; the XLA
dequantizer against the gguf package's, and the tests' K-quant encoder against it.

The K-quants' weights are random bytes with finite f16 scales (every bit pattern of their packed
scales, mins and high bits); the other types' come from the gguf package's quantizer.

Tolerances:
  * the few-rows path rounds each row of x to int8 per block of 32 (as llama.cpp does), so
    against the oracle fed that same rounded x only float summation order differs: every element
    within 1e-5 of the largest |output| (seen: <= 4e-7); against the oracle with x as given the
    rounding shows: RMS error <= 2.5% of the output's RMS (seen: 0.4-0.7%, the rounding's size,
    and up to 1.7% where one row meets 7 outputs: an RMS over 7 numbers);
  * the many-rows path multiplies x as given in f32: within 1e-5 of the largest |output|.

Every type reaches the kernel in its layout (rows interleaved by 16, to_kernel_layout; Q4_K /
Q5_K with their 6-bit scales and mins unpacked); N not a multiple of 16 leaves a padded group,
whose rows the kernel must not return.
"""

import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu import GGUF_KERNEL_TYPES, gguf_matmul_cpu
from kernels_cpu.gguf_matmul import (F32_MIN_ROWS, QK, from_kernel_layout, gguf_dequantize_rows, gguf_matmul_reference,
                                     kernel_layout_take, kernel_type_size, to_kernel_layout)
from tests.helpers.kquants import quantize_kquant

# (M rows, N outputs, K inputs): 1-64 rows, N not a multiple of 8 or of the kernel's tile of 16,
# K from one block to SmolLM2's 1536 (K-quants: one to six super-blocks of 256).
# Every type takes rows of x 4 at a time against a group of 16 weight rows: 1-3, 4, 5, 9, 17, 31
# rows cover whole passes and each remainder; N below, at and past 16, not a multiple of it.
SHAPES = [(1, 7, 32), (2, 16, 64), (3, 37, 96), (4, 45, 576), (5, 100, 1536), (8, 13, 64), (9, 3, 32),
          (16, 19, 96), (17, 21, 64), (31, 11, 128), (64, 33, 160)]
SHAPES_K = [(1, 7, 256), (3, 37, 512), (4, 45, 768), (5, 100, 1536), (8, 13, 256), (16, 19, 256),
            (17, 21, 256), (31, 11, 512), (64, 33, 512)]
K_TYPES = (12, 13, 14)
# Byte offsets of each K-quant's f16 scales in its super-block: d, dmin (Q4_K, Q5_K), d (Q6_K).
_F16_AT = {12: (0, 2), 13: (0, 2), 14: (208,)}
_matmul = jax.jit(gguf_matmul_cpu, static_argnums=2, static_argnames=("f32_min_rows", "n"))
_ids = [t.name for _, t in sorted(GGUF_KERNEL_TYPES.items())]


def _blocks(rng, qtype, n, k):
    """W [n, k] as blocks of ``qtype``: random bytes with finite scales for the K-quants."""
    if qtype not in K_TYPES:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType(qtype))
    bt = GGUF_KERNEL_TYPES[qtype]
    w = rng.integers(0, 256, (n, k // 256, bt.type_size), dtype=np.uint8)
    for at in _F16_AT[qtype]:  # scales of 0.001-0.1: the values stay O(1)
        w[..., at:at + 2] = rng.uniform(1e-3, 0.1, w.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return w.reshape(n, -1)


def _case(rng, qtype, m, n, k):
    w = _blocks(rng, qtype, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    if k > 32:
        x[0, :32] = 0.0  # an all-zero block of x (its scale is 0)
    return x, w


@pytest.mark.parametrize("qtype", sorted(GGUF_KERNEL_TYPES), ids=_ids)
def test_matches_reference(cpu_kernels, qtype):
    rng = np.random.default_rng(qtype)
    for m, n, k in SHAPES_K if qtype in K_TYPES else SHAPES:
        x, w = _case(rng, qtype, m, n, k)
        xj, wj = jnp.asarray(x), jnp.asarray(to_kernel_layout(w, qtype))
        ref = gguf_matmul_reference(x, w, qtype)
        scale = np.abs(ref).max()
        # few rows: int8 x
        out = np.asarray(_matmul(xj, wj, qtype, n=n, f32_min_rows=0))
        assert out.shape == (m, n)
        rounded = gguf_matmul_reference(x, w, qtype, quantize_x=True)
        np.testing.assert_allclose(out, rounded, rtol=0, atol=1e-5 * scale, err_msg=f"int8 {m}x{n}x{k}")
        rel_rms = np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2))
        assert rel_rms <= 0.025, (m, n, k, rel_rms)
        # many rows: f32 tiles
        out32 = np.asarray(_matmul(xj, wj, qtype, n=n, f32_min_rows=1))
        np.testing.assert_allclose(out32, ref, rtol=0, atol=1e-5 * scale, err_msg=f"f32 {m}x{n}x{k}")
        # the default picks by the number of rows
        default = np.asarray(_matmul(xj, wj, qtype, n=n))
        np.testing.assert_array_equal(default, out32 if m >= F32_MIN_ROWS else out)


# The K-quants at 1-64 rows: every remainder of the 4 rows a pass, N not a multiple of 16 (a
# padded group) and below it, K of 1-5 super-blocks (odd counts included).
KQ_ROWS = [(m, n, k) for m, n, k in zip(
    (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 40, 47, 48, 49, 63, 64),
    (1, 3, 9, 7, 17, 5, 23, 8, 37, 2, 19, 11, 33, 6, 16, 13, 9, 41, 3, 25, 10, 21),
    (256, 768, 512, 1280, 256, 512, 768, 256, 1024, 512, 256, 768, 512, 256, 1280, 512, 256, 768, 512, 256, 1024,
     512))]


def _off_ties(x):
    """x with each value that lies within 1e-3 of a rounding tie (x / d_x = i + 0.5) moved a
    quarter step off it: there the kernel's x / d_x (computed as x * (1 / d_x)) and the oracle's may
    round apart, one step of x, which Q5_K's large weights make larger than the tolerance (seen once
    in 4e4 values, by main's kernel too)."""
    xb = x.reshape(x.shape[0], -1, QK).copy()
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    v = xb * np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    near = np.abs(np.abs(v - np.floor(v)) - 0.5) < 1e-3
    xb[near] += np.broadcast_to(0.25 * d, xb.shape)[near]
    return xb.reshape(x.shape)


@pytest.mark.parametrize("qtype", K_TYPES, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_kquants_rows(cpu_kernels, qtype):
    """A K-quant's int8 path at 1-64 rows against the gguf package's dequantizer and a float64
    matmul of x as the kernel rounds it (within 1e-5 of the largest |output|), and each batch's
    first and last rows against that row alone (a pass of 1 row)."""
    rng = np.random.default_rng(600 + qtype)
    for m, n, k in KQ_ROWS:
        x, w = _case(rng, qtype, m, n, k)
        x = _off_ties(x)
        wk = jnp.asarray(to_kernel_layout(w, qtype))
        out = np.asarray(_matmul(jnp.asarray(x), wk, qtype, n=n, f32_min_rows=0))
        exact = gguf_matmul_reference(x, w, qtype, quantize_x=True)
        scale = np.abs(exact).max()
        np.testing.assert_allclose(out, exact, rtol=0, atol=1e-5 * scale, err_msg=f"{m}x{n}x{k}")
        for r in {0, m - 1}:
            alone = np.asarray(_matmul(jnp.asarray(x[r:r + 1]), wk, qtype, n=n, f32_min_rows=0))
            np.testing.assert_allclose(out[r], alone[0], rtol=0, atol=1e-5 * scale, err_msg=f"row {r} {m}x{n}x{k}")
    # The integer sums' extremes: every q at its top (Q4_K 15, Q5_K 31, Q6_K 63: w = 31 d scale),
    # the largest scales and mins (63; Q6_K's -128 and 127), x's blocks all at +-127 once rounded.
    bt = GGUF_KERNEL_TYPES[qtype]
    w = np.full((9, 2, bt.type_size), 0xFF, np.uint8)
    if qtype == 14:
        w[:, :, 192:208] = np.array([-128, 127] * 8, np.int8).view(np.uint8)
    for at in _F16_AT[qtype]:
        w[:, :, at:at + 2] = np.full((9, 2), 0.01, np.float16)[..., None].view(np.uint8)
    w = w.reshape(9, -1)
    for m in (4, 5):
        x = np.where(rng.random((m, 512)) < 0.5, -3.0, 3.0).astype(np.float32)
        x[1] = 3.0
        out = np.asarray(_matmul(jnp.asarray(x), jnp.asarray(to_kernel_layout(w, qtype)), qtype, n=9, f32_min_rows=0))
        exact = gguf_matmul_reference(x, w, qtype, quantize_x=True)
        np.testing.assert_allclose(out, exact, rtol=0, atol=1e-5 * np.abs(exact).max(), err_msg=f"extremes {m}")


def test_leading_dims_and_errors(cpu_kernels):
    rng = np.random.default_rng(1)
    x, w = _case(rng, 8, 6, 9, 64)
    wk = jnp.asarray(to_kernel_layout(w, 8))
    out = gguf_matmul_cpu(jnp.asarray(x).reshape(2, 3, 64), wk, 8, n=9)
    np.testing.assert_allclose(np.asarray(out).reshape(6, 9), np.asarray(_matmul(jnp.asarray(x), wk, 8, n=9)))
    with pytest.raises(ValueError, match="type 6 has no kernel"):  # Q5_0
        gguf_matmul_cpu(jnp.asarray(x), wk, 6)
    with pytest.raises(ValueError, match="does not match Q4_1"):
        gguf_matmul_cpu(jnp.asarray(x), wk, 3, n=9)
    with pytest.raises(ValueError, match="rows interleaved by 16: to_kernel_layout"):  # the file's layout
        gguf_matmul_cpu(jnp.asarray(x), jnp.asarray(w), 8, n=9)
    with pytest.raises(ValueError, match="for 40 rows"):  # more rows than the layout holds
        gguf_matmul_cpu(jnp.asarray(x), wk, 8, n=40)
    # A K-quant's rows are whole super-blocks of 256: 320 inputs are not, nor is a row of 1.5.
    xk, wk = _case(rng, 12, 2, 5, 512)
    with pytest.raises(ValueError, match=r"does not match Q4_K blocks .*256 values in 144 bytes"):
        gguf_matmul_cpu(jnp.zeros((2, 320)), jnp.asarray(wk[:, :288]), 12)
    with pytest.raises(ValueError, match="does not match Q4_K"):
        gguf_matmul_cpu(jnp.asarray(xk), jnp.asarray(wk[:, :216]), 12)


@pytest.mark.parametrize("qtype", sorted(GGUF_KERNEL_TYPES), ids=_ids)
def test_xla_dequantizer_equals_gguf(qtype):
    """gguf_dequantize_rows (the embedding's rows and prefill's W, in XLA) gives the gguf
    package's values exactly, with leading dimensions (a gather's [batch, tokens, row])."""
    rng = np.random.default_rng(100 + qtype)
    w = _blocks(rng, qtype, 12, 512)
    got = np.asarray(jax.jit(gguf_dequantize_rows, static_argnums=1)(jnp.asarray(w.reshape(3, 4, -1)), qtype))
    want = gguf.quants.dequantize(w, gguf.GGMLQuantizationType(qtype)).reshape(3, 4, 512)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", sorted(GGUF_KERNEL_TYPES), ids=_ids)
def test_kernel_layout_round_trips(qtype):
    """to_kernel_layout keeps every byte (the same size but for the padded rows; Q4_K / Q5_K 4 bytes
    more a row and super-block, their unpacked scales), from_kernel_layout gives the file's blocks
    back exactly (the K-quants' random bytes: every bit of their packed scales), and
    kernel_layout_take (the embedding's lookup) the rows asked for, with leading dimensions."""
    rng = np.random.default_rng(200 + qtype)
    w = _blocks(rng, qtype, 37, 512)
    held = to_kernel_layout(w, qtype)
    size = GGUF_KERNEL_TYPES[qtype].type_size
    assert kernel_type_size(qtype) == size + {12: 4, 13: 4}.get(qtype, 0)
    assert held.shape == (3, 16 * w.shape[1] // size * kernel_type_size(qtype))
    # the last group's 11 rows past the tensor are zero blocks (zero scales: zero products)
    padded = np.asarray(from_kernel_layout(jnp.asarray(held), qtype, 48))[37:]
    assert not np.any(padded)
    np.testing.assert_array_equal(np.asarray(from_kernel_layout(jnp.asarray(held), qtype, 37)), w)
    ids = np.array([[0, 36, 15, 16], [17, 31, 32, 5]])
    got = jax.jit(kernel_layout_take, static_argnums=2)(jnp.asarray(held), jnp.asarray(ids), qtype)
    np.testing.assert_array_equal(np.asarray(got), w[ids])


@pytest.mark.parametrize("qtype", K_TYPES, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_encoder_round_trips(qtype):
    """The tests' K-quant encoder (tests/helpers/kquants.py, which writes the tiny GGUFs): the gguf
    package reads its blocks back as exactly the values it meant, and those are the weights
    within each type's rounding (RMS error, as a fraction of the weights' RMS, seen: Q4_K 7.8%,
    Q5_K 3.8%, Q6_K 1.9%, on rows of mixed scales)."""
    rng = np.random.default_rng(qtype)
    w = rng.standard_normal((37, 512)).astype(np.float32) * rng.uniform(0.1, 3, (37, 1)).astype(np.float32)
    w[0, :256] = 0.0  # a zero super-block: zero scales
    blocks, values = quantize_kquant(w, gguf.GGMLQuantizationType(qtype))
    assert blocks.shape == (37, 2 * GGUF_KERNEL_TYPES[qtype].type_size) and blocks.dtype == np.uint8
    np.testing.assert_array_equal(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)), values)
    assert np.all(values[0, :256] == 0)
    rel_rms = np.sqrt(np.mean((values - w) ** 2) / np.mean(w ** 2))
    assert rel_rms <= {12: 0.09, 13: 0.045, 14: 0.022}[qtype], rel_rms
    with pytest.raises(ValueError, match="whole super-blocks of 256"):
        quantize_kquant(w[:, :320], gguf.GGMLQuantizationType(qtype))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


# -march=x86-64: the plain C++ path (no AVX2). haswell: AVX2 without AVX-512 or VNNI (the AVX2
# machines' build): maddubs for the integer dots, 4 weight rows a pass, Q8_0's sign trick.
@pytest.mark.parametrize("march", ["x86-64", "haswell"])
def test_other_builds_match_reference(tmp_path, march):
    """The kernel built for another CPU than this one, in a fresh process (a process registers
    one library per target): 1, 3, 5 and 16 rows (passes of 4 rows of x and their remainders) and
    33 (the K-quants' lanes path: 4 groups of 8 rows and a padded one, 4 weight rows a pass)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the builds are forced with -march={march}; this is {platform.machine()}")
    if march == "haswell" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU cannot run a -march=haswell build (no AVX2, FMA or F16C)")
    code = f"""
import numpy as np, jax.numpy as jnp
from kernels_cpu import build, gguf_matmul_cpu
from kernels_cpu.gguf_matmul import gguf_matmul_reference
import tests.kernels_cpu.test_gguf_matmul as t
build._COMPILE = [f if f != "-march=native" else "-march={march}" for f in build._COMPILE]
build.load_cpu_kernels({str(tmp_path)!r})
rng = np.random.default_rng(0)
for qtype in (2, 3, 8, 12, 13, 14):
    for m in (1, 3, 5, 16, 33):
        x, w = t._case(rng, qtype, m, 19, 512 if qtype in t.K_TYPES else 96)
        x = t._off_ties(x)
        wk = jnp.asarray(t.to_kernel_layout(w, qtype))
        for rows, quantize_x in ((0, True), (1, False)):  # the int8 path, the f32 path
            out = np.asarray(gguf_matmul_cpu(jnp.asarray(x), wk, qtype, n=19, f32_min_rows=rows))
            exact = gguf_matmul_reference(x, w, qtype, quantize_x=quantize_x)
            np.testing.assert_allclose(out, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "KernelBuildError" in done.stderr:
        pytest.skip(f"the C++ kernels cannot be built here: {done.stderr[-300:]}")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
