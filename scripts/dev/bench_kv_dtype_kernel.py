"""The C++ decode kernel alone, float32 cache against fp8 (e4m3) bytes, at bench_kv_dtype.py's shapes.

SmolLM2-135M's attention (3 KV heads x 3 query heads, head_dim 64), --batch tokens each reading
--context + 1 keys through its own pages, one cache per layer (--layers of them: together larger
than the last-level cache, as in a decode step) and one program calling the kernel once per layer.
Rounds alternate the two; medians. Reports the bytes of K/V read and the rate.

    python scripts/dev/bench_kv_dtype_kernel.py --batch 32 --context 1024 --layers 30 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_cpu.build import load_cpu_kernels
    from kernels_cpu.paged_decode import paged_decode_cpu

    load_cpu_kernels(os.environ.get("JAXLM_CACHE_DIR"))
    T, hkv, G, D, bs = args.batch, 3, 3, 64, 16
    pages = -(-(args.context + 64) // bs)
    rng = np.random.default_rng(0)
    caches = {"float32": [], "fp8": []}
    for _ in range(args.layers):
        x = jnp.asarray(rng.standard_normal((2, T * pages + 1, bs, hkv, D), np.float32))
        caches["float32"].append(x)
        caches["fp8"].append(jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8))
    tables = jnp.asarray(1 + np.arange(T * pages, dtype=np.int32).reshape(T, pages))
    q = jnp.asarray(rng.standard_normal((T, hkv, G, D), np.float32) * D ** -0.5)
    pos, rows = jnp.full((T,), args.context, jnp.int32), jnp.arange(T, dtype=jnp.int32)

    def program(fp8: bool):
        kw = {"cache_dtype": jnp.float8_e4m3fn} if fp8 else {}

        def run(cs, q):
            out = q
            for c in cs:  # each layer's output is the next one's query: the calls run in order
                out = paged_decode_cpu(out, c, pos, rows, tables, jnp.int32(T), jnp.zeros_like(q), **kw)
            return out
        return jax.jit(run)

    runs = {name: (program(name == "fp8"), cs) for name, cs in caches.items()}
    for f, cs in runs.values():
        f(cs, q).block_until_ready()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (f, cs) in runs.items():
            t = time.perf_counter()
            f(cs, q).block_until_ready()
            times[name].append(time.perf_counter() - t)
    kv = args.layers * T * (args.context + 1) * hkv * D * 2  # K and V elements read
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, m in med.items():
        read = kv * (4 if name == "float32" else 1)
        print(f"{name}: {args.layers} layers median {m * 1e3:.1f} ms (min {min(times[name]) * 1e3:.1f}), "
              f"{m * 1e3 / args.layers:.2f} ms a layer; K/V read {read / 1e6:.0f} MB = {read / m / 1e9:.2f} GB/s")
    print(f"fp8 / float32: {med['float32'] / med['fp8']:.2f}x")


if __name__ == "__main__":
    main()
