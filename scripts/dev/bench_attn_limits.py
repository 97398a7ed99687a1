"""The XLA prefill tiles with and without AttentionMetadata.attn_limits (Gemma 3's image tokens
seeing their whole image): one 512-token prompt, 8 query / 4 KV heads of 128, pages of 16;
causal, limits equal to the positions (a text step of a Gemma 3 image model), and two image
runs (256 tokens at 20, 200 at 300). Alternating runs, medians.

    python scripts/dev/bench_attn_limits.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.attention.xla_backend import paged_attention_xla
from tests.helpers.ragged_batch import ragged_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cache, (k, v), md = ragged_step(rng, [(0, 512)], 16, 4, 128, garbage=0.0, pad_tokens=0, pad_rows=0)
    q = jnp.asarray(rng.standard_normal((512, 8, 128)).astype(np.float32))
    k, v, cache = jnp.asarray(k), jnp.asarray(v), jnp.asarray(cache)
    pos = np.asarray(md.positions)
    images = pos.copy()
    images[20:276], images[300:500] = 275, 499
    cases = {"causal (None)": md,
             "limits = positions": dataclasses.replace(md, attn_limits=jnp.asarray(pos, jnp.int32)),
             "two image runs": dataclasses.replace(md, attn_limits=jnp.asarray(images, jnp.int32))}
    fn = jax.jit(functools.partial(paged_attention_xla, scale=128 ** -0.5))
    for m in cases.values():
        jax.block_until_ready(fn(q, k, v, cache, m))
    times: dict[str, list[float]] = {n: [] for n in cases}
    for _ in range(args.rounds):
        for name, m in cases.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k, v, cache, m))
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name:20s} median {1e3 * np.median(ts):.2f} ms")


if __name__ == "__main__":
    main()
