"""The C++ paged decode kernel against the pure-JAX reference (kernels_pallas.reference)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu import paged_decode_cpu
from kernels_pallas.reference import paged_decode_reference


def _case(rng, *, T, hq, hkv, d, bs, nb, pages, dtype):
    cache = rng.standard_normal((2, nb, bs, hkv, d)).astype(np.float32)
    rows = rng.integers(0, 5, T).astype(np.int32)
    tables = np.stack([rng.permutation(nb)[:pages] for _ in range(5)]).astype(np.int32)
    positions = rng.integers(0, pages * bs, T).astype(np.int32)
    positions[:3] = [0, bs - 1, pages * bs - 1]  # one key, a page's last, the table's last
    # Pages nobody reads hold garbage that must not leak.
    used = {int(tables[r, j // bs]) for r, p in zip(rows, positions) for j in range(p + 1)}
    cache[:, [b for b in range(nb) if b not in used]] = np.nan
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(cache, dtype), jnp.asarray(positions), jnp.asarray(rows), jnp.asarray(tables)


# fp8 (--kv-cache-dtype fp8 / fp8_e5m2): the kernel converts each byte to float itself; the reference
# reads the same fp8 cache through XLA's conversion, so the two agree as closely as for f32.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (9, 3, 64), (8, 1, 32)])
@pytest.mark.parametrize("window,cap", [(None, None), (7, None), (None, 5.0), (20, 30.0)])
def test_matches_reference(cpu_kernels, dtype, hq, hkv, d, window, cap):
    rng = np.random.default_rng(hq * 31 + d)
    T, nd, bs = 70, 66, 16
    q, cache, positions, rows, tables = _case(rng, T=T, hq=hq, hkv=hkv, d=d, bs=bs, nb=300, pages=20, dtype=dtype)
    scale = d ** -0.5
    before = jnp.full((T, hkv, hq // hkv, d), 7.0, jnp.float32)  # rows past num_decode keep these

    @jax.jit
    def run(q, cache, positions, rows, tables, before):
        qf = q.reshape(T, hkv, hq // hkv, d) * scale
        return paged_decode_cpu(qf, cache, positions, rows, tables, jnp.int32(nd), before, window=window, cap=cap)

    out = np.asarray(run(q, cache, positions, rows, tables, before)).reshape(T, hq, d)
    ref = np.asarray(paged_decode_reference(q, cache, tables, rows, positions + 1, scale=scale,
                                            sliding_window=window, logits_soft_cap=cap))
    np.testing.assert_allclose(out[:nd], ref[:nd], atol=2e-5, rtol=1e-5)
    assert np.all(out[nd:] == 7.0)


def test_out_of_range_inputs_stay_in_bounds(cpu_kernels):
    """Rows, pages and positions past their tables (what padding may hold) read valid memory and
    give finite values; a num_decode past T counts T."""
    rng = np.random.default_rng(3)
    q, cache, _, _, tables = _case(rng, T=4, hq=4, hkv=2, d=16, bs=4, nb=8, pages=2, dtype=jnp.float32)
    cache = jnp.nan_to_num(cache)
    tables = tables.at[0].set(jnp.array([10**6, -5], jnp.int32))
    positions = jnp.array([2**31 - 1, -7, 3, 0], jnp.int32)
    rows = jnp.array([0, 99, -3, 1], jnp.int32)
    out = paged_decode_cpu(q.reshape(4, 2, 2, 16), cache, positions, rows, tables, jnp.int32(2**30),
                           jnp.zeros((4, 2, 2, 16), jnp.float32))
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    assert np.all(out[1] == 0.0)  # a negative position has no keys


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_conversion_is_exact_for_every_byte(cpu_kernels, dtype):
    """All 256 fp8 codes (subnormals, the extremes, negatives, NaN, e5m2's infinities) come out
    of the kernel's integer conversion as XLA converts them: token t reads only key t (window 1),
    whose V holds code t, so its output is that value."""
    n, d = 256, 16
    cache = np.zeros((2, 1, n, 1, d), np.uint8)
    cache[1, 0, :, 0, :] = np.arange(n, dtype=np.uint8)[:, None]
    cache = jnp.asarray(cache).view(dtype)
    out = paged_decode_cpu(jnp.zeros((n, 1, 1, d), jnp.float32), cache, jnp.arange(n, dtype=jnp.int32),
                           jnp.zeros(n, jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.int32(n),
                           jnp.zeros((n, 1, 1, d), jnp.float32), window=1)
    want = np.asarray(cache[1, 0, :, 0, :].astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(out)[:, 0, 0, :], want)  # NaN == NaN here


# Work items: with T=12 tokens (at least 4 a thread, up to 3 threads) an item takes all of a
# token's KV heads (float32, and fp8 on the AVX2 and AVX-512 paths), with T=5 one KV head
# (fewer than 4 tokens a thread, from 2 threads on); bf16 takes one head an item either way.
_NAN_CASES = [(6, 2, 64), (5, 1, 16), (6, 2, 24), (8, 2, 128), (4, 1, 32)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("hq,hkv,d", _NAN_CASES)
@pytest.mark.parametrize("T", [12, 5])
def test_nan_in_read_rows_and_any_head_dim_match_reference(cpu_kernels, dtype, hq, hkv, d, T):
    """The rows the kernel reads may hold NaN (for fp8, e4m3fn's S.1111.111 has no half-precision
    twin, so the fast paths must notice it, in rows of 16, 32, 64 and 128 bytes): a token that
    reads one gets NaN for the heads of that KV head, as the reference does, and every other value
    still matches, whether a work item is one KV head of a token or all of them (T, above).
    d=24 takes the generic path (head_dim without a specialised kernel); G=5 and G=4 at d=128
    split the fp8 V sums into groups."""
    rng = np.random.default_rng(d + hq)
    bs = 16
    q, cache, positions, rows, tables = _case(rng, T=T, hq=hq, hkv=hkv, d=d, bs=bs, nb=64, pages=6, dtype=jnp.float32)
    cache = np.array(cache)
    # A NaN in K of token 3's last key (KV head 0) and in V of token 4's first key (last KV head).
    for t, which, key, h in [(3, 0, int(positions[3]), 0), (4, 1, 0, hkv - 1)]:
        cache[which, int(tables[rows[t], key // bs]), key % bs, h, d // 3] = np.nan
    cache = jnp.asarray(cache, dtype)
    scale = d ** -0.5
    qf = q.reshape(T, hkv, hq // hkv, d) * scale
    out = paged_decode_cpu(qf, cache, positions, rows, tables, jnp.int32(T), jnp.zeros_like(qf))
    out = np.asarray(out).reshape(T, hq, d)
    ref = np.asarray(paged_decode_reference(q, cache, tables, rows, positions + 1, scale=scale))
    hit = np.isnan(ref).any(axis=-1)  # [T, hq]: the query heads that read a NaN row (rows may share pages)
    assert hit[3].any() and hit[4].any() and not hit.all()
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1), hit)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("march,needs", [("x86-64", ()), ("x86-64-v3", ("avx2", "f16c", "fma"))],
                         ids=["x86-64", "x86-64-v3"])
def test_fp8_portable_builds_match_reference(tmp_path, march, needs):
    """The fp8 paths a -march=native build may not take here, each built in a fresh process (a
    process registers one library per target): x86-64, the integer conversion on chunks of rows;
    x86-64-v3, the AVX2 + F16C path (an AVX-512 CPU takes the AVX-512 one natively), and float32
    compiled for each. Against the reference with NaN garbage pages and NaN rows (work items of
    one KV head and of a whole token), and every byte value exact."""
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the builds are forced with -march={march}; this is {platform.machine()}")
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    if missing := [n for n in needs if n not in flags]:
        pytest.skip(f"-march={march} code needs {missing}, which this CPU lacks")
    code = f"""
import numpy as np, jax.numpy as jnp
from kernels_cpu import build
import tests.kernels_cpu.test_paged_decode as t
build._COMPILE = [f if f != "-march=native" else "-march={march}" for f in build._COMPILE]
build._SOURCES, build.TARGETS = build._SOURCES[:1], build.TARGETS[:1]  # paged_decode.cc alone
build.load_cpu_kernels({str(tmp_path)!r})
for dtype in (jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2):
    t.test_matches_reference(None, dtype, 9, 3, 64, None, None)
    t.test_matches_reference(None, dtype, 8, 1, 32, 7, 30.0)
    if dtype != jnp.float32:
        t.test_fp8_conversion_is_exact_for_every_byte(None, dtype)
    for hq, hkv, d in t._NAN_CASES:
        for T in (12, 5):
            t.test_nan_in_read_rows_and_any_head_dim_match_reference(None, dtype, hq, hkv, d, T)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "KernelBuildError" in done.stderr:
        pytest.skip(f"the C++ kernels cannot be built here: {done.stderr[-300:]}")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
