"""The C++ decode attention kernel (kernels_cpu) alone: us per call in a jit of chained calls.

    python scripts/bench_cpu_decode.py                                   # SmolLM2's heads, 1 row, 152 keys
    python scripts/bench_cpu_decode.py --heads 2,2,16 --layers 2 --tokens 64 --context 165   # the tiny Llama
    taskset -c 0 python scripts/bench_cpu_decode.py ...                  # one core (no thread split)

Every row reads its own pages from a random block table over the cache (as a real step's rows
do), so the pages come from memory, not from one warm page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="3,3,64", help="KV heads, query heads per KV head, head_dim")
    p.add_argument("--tokens", type=int, default=1, help="decode rows")
    p.add_argument("--context", type=int, default=152, help="keys each row reads")
    p.add_argument("--layers", type=int, default=30, help="calls chained in one program")
    p.add_argument("--blocks", type=int, default=1456)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=200)
    a = p.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlm.attention.backends import kernel_build_dir
    from kernels_cpu import load_cpu_kernels, paged_decode_cpu

    load_cpu_kernels(kernel_build_dir())
    hkv, g, d = (int(x) for x in a.heads.split(","))
    T, bs = a.tokens, a.block_size
    pages = -(-a.context // bs)
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((2, a.blocks, bs, hkv, d)).astype(np.float32))
    tables = jnp.asarray(np.stack([rng.permutation(a.blocks)[:pages] for _ in range(T)]).astype(np.int32))
    pos, rows = jnp.full((T,), a.context - 1, jnp.int32), jnp.arange(T, dtype=jnp.int32)
    q = jnp.asarray(rng.standard_normal((T, hkv, g, d)).astype(np.float32))

    @jax.jit
    def chain(q, cache):
        o = q
        for _ in range(a.layers):
            o = paged_decode_cpu(o, cache, pos, rows, tables, jnp.int32(T), jnp.zeros_like(q))
        return o

    chain(q, cache).block_until_ready()
    ts = []
    for _ in range(a.reps):
        t = time.perf_counter()
        chain(q, cache).block_until_ready()
        ts.append(time.perf_counter() - t)
    print(f"{T} rows x {a.context} keys, heads {a.heads}: {statistics.median(ts) / a.layers * 1e6:.1f} us per call "
          f"(median of {a.reps}), min {min(ts) / a.layers * 1e6:.1f}")


if __name__ == "__main__":
    main()
