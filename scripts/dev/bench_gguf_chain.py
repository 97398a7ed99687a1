"""A batch-1 decode token's GGUF block products alone: what the C++ kernel costs of a step.

    python scripts/dev/bench_gguf_chain.py [--rounds 30] [--layers 30]

SmolLM2-135M's shapes: per layer q/k/v/o, gate/up and down in Q4_1 (each layer its own copy of the
blocks, so, as in the model, the 96 MB a token streams never stay in L2), then the tied 49152 x 576
LM head in Q8_0: 211 products on one row of x, chained in one jitted program (each product's input
depends on the last). Prints the median and minimum ms of the chain; compare with the engine's ms
a token (scripts/dev/bench_gguf_e2e.py) for the share of the step that is the kernel, and with
the weight bytes for the bandwidth it reaches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
Q4_1, Q8_0 = 3, 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--gap", type=int, default=0,
                   help="values of dependent single-threaded XLA work between a layer's attention and MLP "
                        "products (0: none), standing in for the step's other ops")
    args = p.parse_args()

    import gguf
    import jax
    import jax.numpy as jnp

    from kernels_cpu import gguf_matmul_cpu, load_cpu_kernels
    from kernels_cpu.gguf_matmul import to_kernel_layout

    load_cpu_kernels(os.path.join(os.environ.get("JAXLM_CACHE_DIR") or "/tmp", "kernels"))
    rng = np.random.default_rng(0)
    quant = lambda shape, t: to_kernel_layout(gguf.quants.quantize(  # noqa: E731
        (rng.standard_normal(shape) * 0.05).astype(np.float32), gguf.GGMLQuantizationType(t)), t)
    base = {s: quant(s, Q4_1) for s in SHAPES}
    layers = [[jnp.asarray(base[s].copy()) for s in SHAPES] for _ in range(args.layers)]
    head = jnp.asarray(quant((49152, 576), Q8_0))
    mm = lambda x, w, t: gguf_matmul_cpu(x, w, t, f32_min_rows=0)  # noqa: E731

    def token(x, layers, head):
        for q_w, k_w, v_w, o_w, g_w, u_w, d_w in layers:
            q, k, v = mm(x, q_w, Q4_1), mm(x, k_w, Q4_1), mm(x, v_w, Q4_1)
            a = q + jnp.pad(k + v, ((0, 0), (0, 384)))
            if args.gap:
                a = a + 1e-9 * jnp.sum(jnp.sin(filler + a[0, 0]))
            o = mm(a, o_w, Q4_1)
            x = x + 1e-3 * mm(mm(o, g_w, Q4_1) * mm(o, u_w, Q4_1), d_w, Q4_1)
        return mm(x, head, Q8_0)

    filler = jnp.asarray(rng.standard_normal(max(args.gap, 1)).astype(np.float32))
    f = jax.jit(token)
    x = jnp.asarray(rng.standard_normal((1, 576)).astype(np.float32))
    f(x, layers, head).block_until_ready()
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        f(x, layers, head).block_until_ready()
        times.append(time.perf_counter() - t0)
    nbytes = sum(w.nbytes for layer in layers for w in layer) + head.nbytes
    med = statistics.median(times)
    print(f"{7 * args.layers + 1} block products, 1 row, {nbytes / 1e6:.1f} MB of blocks: median {med * 1e3:.2f} ms "
          f"({nbytes / med / 1e9:.1f} GB/s), min {min(times) * 1e3:.2f} ms; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
