#!/usr/bin/env python3
"""Decode attention benchmark: kernels_pallas vs JAX's bundled Pallas paged attention vs XLA.

    jaxlm bench kernels                 # batch 1/16/64 x context 512/2k/8k, bf16
    jaxlm bench kernels --batch 1 --context 8192 --peak-gbps 3350

For each shape it checks ours against the XLA reference, then reports time per call and the
achieved HBM bandwidth: the bytes that *must* be read (every context token's K and V of every
KV head, plus q and the output) divided by the time, next to the device's peak bandwidth.
Decode attention is memory bound, so %peak is the figure of merit.

Columns:
  ours      kernels_pallas.paged_decode_attention (attention only, cache layout
            [2, num_blocks, block_size, Hkv, D], split-K from PallasConstraints)
  ours+wr   jaxlm's pallas backend with the decode hint (max_query_len=1): K/V scatter of
            the new token + the decode kernel
  ragged    the same backend without the hint (what a runner that does not pass it gets):
            K/V scatter + the ragged prefill/mixed kernel
  jax-pl    jax.experimental.pallas.ops.gpu.paged_attention.paged_attention (layout
            [Hkv, pages, page_size, D], block_h=16, k_splits=min(16, pages))
  xla       jaxlm.attention.xla_backend.paged_attention_xla (includes its K/V scatter)
Needs a GPU: without one it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# Peak HBM bandwidth in GB/s by device_kind substring (vendor datasheets).
PEAK_GBPS = {
    "H200": 4800, "H100 PCIe": 2000, "H100": 3350, "B200": 8000, "GH200": 4000,
    "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300,
    "A10G": 600, "RTX 4090": 1008,
}


def peak_gbps(kind: str) -> float | None:
    for key in sorted(PEAK_GBPS, key=len, reverse=True):  # most specific first
        if key.lower() in kind.lower():
            return float(PEAK_GBPS[key])
    return None


def bench(fn, *args, iters: int, repeats: int = 5) -> float:
    """Median seconds per call of an already-jitted fn (dispatch overlapped, like serving)."""
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times))


def make_inputs(B: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype, P: int):
    from jaxlm.attention.metadata import AttentionMetadata

    rng = np.random.default_rng(0)
    pages_per_req = -(-ctx // bs)
    num_blocks = B * pages_per_req + 1
    perm = rng.permutation(num_blocks - 1).astype(np.int32) + 1  # block 0 = padding target
    tables = np.zeros((B, P), np.int32)
    tables[:, :pages_per_req] = perm[: B * pages_per_req].reshape(B, pages_per_req)
    key = jax.random.PRNGKey(0)
    kq, kc, kn = jax.random.split(key, 3)
    cache = jax.random.normal(kc, (2, num_blocks, bs, hkv, d), dtype)
    q = jax.random.normal(kq, (B, hq, d), dtype)
    k_new, v_new = jax.random.normal(kn, (2, B, hkv, d), dtype)
    pos = np.full((B,), ctx - 1, np.int32)
    slots = tables[np.arange(B), pos // bs] * bs + pos % bs
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    md = AttentionMetadata(
        positions=i32(pos), slot_mapping=i32(slots), token_to_req=i32(np.arange(B)),
        block_tables=i32(tables), seq_lens=i32(np.full(B, ctx)),
        context_lens=i32(np.full(B, ctx - 1)), query_start_loc=i32(np.arange(B + 1)))
    return q, k_new, v_new, cache, md


def run_shape(B, ctx, args, dtype, peak) -> dict:
    from jaxlm.attention.pallas_backend import PallasBackend, PallasConstraints
    from jaxlm.attention.xla_backend import paged_attention_xla
    from kernels_pallas.paged_decode import paged_decode_attention

    hq, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    c = PallasConstraints.for_cache(bs, d)
    P = c.round_pages(-(-ctx // bs))
    q, k_new, v_new, cache, md = make_inputs(B, ctx, hq, hkv, d, bs, dtype, P)
    scale = d ** -0.5
    splits = c.num_splits(B, hkv, P)
    kv_lens = md.positions + 1

    ours = jax.jit(lambda q, cache, bt, rows, lens: paged_decode_attention(
        q, cache, bt, rows, lens, scale=scale, pages_per_compute_block=c.decode_pages_per_block,
        num_splits=splits, interpret=args.interpret))
    backend = PallasBackend(interpret=args.interpret)
    ours_wr = jax.jit(lambda q, k, v, cache, md: backend(
        q, k, v, cache, md, scale=scale, max_query_len=1), donate_argnums=(3,))
    ragged = jax.jit(lambda q, k, v, cache, md: backend(q, k, v, cache, md, scale=scale),
                     donate_argnums=(3,))
    xla = jax.jit(lambda q, k, v, cache, md: paged_attention_xla(q, k, v, cache, md, scale=scale),
                  donate_argnums=(3,))

    # Correctness first (cache already holds the new token at its slot after a write).
    from jaxlm.attention.xla_backend import write_kv
    cache = jax.block_until_ready(write_kv(cache, k_new, v_new, md.slot_mapping))
    o_ours = ours(q, cache, md.block_tables, md.token_to_req, kv_lens)
    o_ref, _ = paged_attention_xla(q, k_new, v_new, jnp.copy(cache), md, scale=scale)
    err = float(jnp.max(jnp.abs(o_ours.astype(jnp.float32) - o_ref.astype(jnp.float32))))

    itemsize = jnp.dtype(dtype).itemsize
    nbytes = B * ctx * hkv * d * 2 * itemsize + 2 * B * hq * d * itemsize
    row = dict(B=B, ctx=ctx, splits=splits, mb=nbytes / 1e6, err=err)
    row["ours"] = bench(ours, q, cache, md.block_tables, md.token_to_req, kv_lens,
                        iters=args.iters)

    def donated(fn):
        # A donated cache is consumed: thread it through the timed calls.
        state = {"cache": jnp.copy(cache)}

        def call():
            out, state["cache"] = fn(q, k_new, v_new, state["cache"], md)
            return out
        return call

    row["ours+wr"] = bench(donated(ours_wr), iters=args.iters)
    row["ragged"] = bench(donated(ragged), iters=args.iters)
    row["xla"] = bench(donated(xla), iters=args.iters)
    row["jax-pl"] = bench_bundled(q, cache, md, ctx, bs, args.iters, args.interpret)
    return row


def bench_bundled(q, cache, md, ctx, bs, iters, interpret) -> float | None:
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as pa
    except ImportError:
        return None
    pages = -(-ctx // bs)
    k_splits = max(s for s in (1, 2, 4, 8, 16) if pages % s == 0)
    # Its layout is head-major: [Hkv, pages, page_size, D]; same bytes, copied once here.
    k_pages = jnp.transpose(cache[0], (2, 0, 1, 3))
    v_pages = jnp.transpose(cache[1], (2, 0, 1, 3))
    bt = md.block_tables[:, :pages]
    fn = jax.jit(lambda q, k, v, bt, lens: pa.paged_attention(
        q, k, v, bt, lens, block_h=16, pages_per_compute_block=max(1, 128 // bs),
        k_splits=k_splits, interpret=interpret))
    try:
        return bench(fn, q, k_pages, v_pages, bt, md.seq_lens, iters=iters)
    except Exception as e:  # keep the table going; say why
        print(f"  jax-pl failed at B={q.shape[0]} ctx={ctx}: {type(e).__name__}: {e}"[:300])
        return None


def fmt(t: float | None, nbytes_mb: float, peak: float | None) -> str:
    if t is None:
        return f"{'n/a':>22}"
    gbps = nbytes_mb / 1e3 / t
    pct = f"{100 * gbps / peak:4.0f}%" if peak else "   ?"
    return f"{t * 1e6:8.1f}us {gbps:6.0f}GB/s {pct}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxlm bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--peak-gbps", type=float, default=None, help="override the HBM peak")
    p.add_argument("--json", default=None, help="also write the rows (seconds) to this file")
    p.add_argument("--interpret", action="store_true",
                   help="smoke-test this script on CPU (interpret mode; timings meaningless)")
    args = p.parse_args(argv)

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if args.interpret:
        gpus = gpus or jax.devices()
        print("interpret mode: checking the script runs; the timings below mean nothing")
    elif not gpus:
        print(f"jaxlm bench kernels: no GPU found (jax backend is {jax.default_backend()!r}); the "
              "Pallas GPU kernels only run in interpret mode here, whose timings mean "
              "nothing. Run this on a CUDA machine with jax[cuda12] or jax[cuda13].")
        return 2
    kind = gpus[0].device_kind
    peak = args.peak_gbps or peak_gbps(kind)
    dtype = jnp.dtype(args.dtype)
    print(f"device: {kind}  peak HBM: {peak or 'unknown (use --peak-gbps)'} GB/s  "
          f"jax {jax.__version__}  Hq={args.num_heads} Hkv={args.num_kv_heads} "
          f"D={args.head_dim} page={args.block_size} {args.dtype}")
    cols = ["ours", "ours+wr", "ragged", "jax-pl", "xla"]
    print(f"{'B':>3} {'ctx':>5} {'S':>2} {'KV MB':>7} {'maxerr':>7} | "
          + " | ".join(f"{c:^22}" for c in cols))
    rows = []
    for B in args.batch:
        for ctx in args.context:
            r = run_shape(B, ctx, args, dtype, peak)
            rows.append(r)
            print(f"{B:>3} {ctx:>5} {r['splits']:>2} {r['mb']:7.1f} {r['err']:7.1e} | "
                  + " | ".join(fmt(r[c], r["mb"], peak) for c in cols), flush=True)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(dict(device=kind, peak_gbps=peak, jax=jax.__version__, args=vars(args),
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
