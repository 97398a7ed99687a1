"""Cost of sampling per decode step: greedy vs. every filter on, jitted, at R x V.

    python scripts/bench_sampler.py                     # R = 1, 16, 64; V = 49152
    python scripts/bench_sampler.py --rows 64 --iters 20 --dist flat

Reports the device time of one sample() call (median of --iters, after compile) and the host
time of SamplingInputBuilder.build() (numpy + device_put) for these configurations:
  greedy        temperature 0 (argmax only)
  greedy+lp     greedy with logprobs=20
  temperature   temperature 0.8 (inverse-CDF draw, no filters)
  top-k/p       temperature 0.8, top_k 50, top_p 0.9, min_p 0.05
  all           top-k/p + presence/frequency/repetition penalties + logit_bias + logprobs 20
--dist peaked (default) gives LM-like logits (Zipf-shaped); --dist flat gives near-uniform
logits (a top-p nucleus far larger than the 256 candidates: the truncated case).
Configs are timed round-robin (the host's speed drifts); compare the x-greedy ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm.sample import SamplingInputBuilder, sample  # noqa: E402
from jaxlm.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("bench_sampler")

CONFIGS: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "greedy+lp": dict(temperature=0.0, logprobs=20),
    "temperature": dict(temperature=0.8),
    "top-k/p": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "all": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={1: 2.0, 2: -5.0},
                logprobs=20),
}


def make_logits(rows: int, vocab: int, dist: str, seed: int = 0) -> np.ndarray:
    rs = np.random.RandomState(seed)
    if dist == "flat":
        return rs.randn(rows, vocab).astype(np.float32) * 0.1
    # LM-like: Zipf-shaped probabilities (exponent 2) over a random permutation, plus noise.
    rank = np.stack([rs.permutation(vocab) for _ in range(rows)]) + 1
    return (-2.0 * np.log(rank) + 0.3 * rs.randn(rows, vocab)).astype(np.float32)


def bench(rows: int, vocab: int, iters: int, dist: str) -> dict[str, dict[str, float]]:
    """Compile every config first, then time them round-robin so host drift hits all alike."""
    step = jax.jit(sample)
    logits = jnp.asarray(make_logits(rows, vocab, dist))
    setups = {}
    for name, cfg in CONFIGS.items():
        b = SamplingInputBuilder(vocab, 2048)
        ids = [f"r{i}" for i in range(rows)]
        for i, rid in enumerate(ids):
            b.add_request(rid, SamplingParams(seed=i, **cfg), list(range(100, 228)), list(range(300, 364)))
        jax.block_until_ready(step(logits, b.build(ids, rows)))  # compile
        setups[name] = (b, ids)
    dev: dict[str, list[float]] = {n: [] for n in CONFIGS}
    host: dict[str, list[float]] = {n: [] for n in CONFIGS}
    for _ in range(iters):
        for name, (b, ids) in setups.items():
            t0 = time.perf_counter()
            md = jax.block_until_ready(b.build(ids, rows))
            t1 = time.perf_counter()
            jax.block_until_ready(step(logits, md))
            t2 = time.perf_counter()
            host[name].append((t1 - t0) * 1e3)
            dev[name].append((t2 - t1) * 1e3)
    results = {}
    base = statistics.median(dev["greedy"])
    for name in CONFIGS:
        results[name] = {"sample_ms": statistics.median(dev[name]), "build_ms": statistics.median(host[name])}
        logger.info("R=%-3d V=%d %-12s sample %8.2f ms (x%.1f greedy)  build %6.2f ms", rows, vocab, name,
                    results[name]["sample_ms"], results[name]["sample_ms"] / base, results[name]["build_ms"])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dist", choices=["peaked", "flat"], default="peaked")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("backend=%s devices=%s", jax.default_backend(), jax.devices())
    out = {str(r): bench(r, args.vocab, args.iters, args.dist) for r in args.rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
