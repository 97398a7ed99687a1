"""Compare bucket configurations on a workload: compile cost, padding, throughput, latency, memory.

    python scripts/bench.py                                   # synthetic mixed workload, default model, pow2
    python scripts/bench.py --buckets pow2 linear:64 auto --max-programs 40 --json out.json --plot out.png
    python scripts/bench.py --workload prompts.jsonl --request-rate 2 --buckets "tokens=16,64,256,512;seqs=1,8,64"
    python scripts/bench.py --vs-hf --roofline                # + transformers side by side, % of machine limits
    python scripts/bench.py --sampling                        # decode with every sampling filter on vs greedy
    python scripts/bench.py --structured                      # decode under a JSON schema vs none, batch 1 and 16
    python scripts/bench.py --host-overhead                   # tiny model: ms per decode step at batch 1/8/64, by part
    python scripts/bench.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'  # vs none
    python scripts/bench.py --lora-modules [NAME=PATH ...]    # batch-64 decode: base vs 4 adapters, adapter load time
    python scripts/bench.py --lora-delta                      # the LoRA delta's candidate forms at SmolLM2's shapes
    python scripts/bench.py --moe --vs-hf                     # synthetic MoE: 64 vs 8 experts, EP=4 bytes, vs HF
    python scripts/bench.py --prefill --prefill-profile 500  # prefill tok/s vs transformers, cached suffix, profile

Bucket configs: pow2 (the engine default), pow4, linear:STEP, a comma list of token buckets,
tokens=A;seqs=B (each any of those), auto (derived by simulating the scheduler on the workload
under --max-programs; printed as the flags to pass to `python -m jaxlm.serve` / LLM(...)).
Each configuration runs in its own processes: one cold warm-up with an empty compile cache, one
that warms up from that cache and serves the workload (so peak RSS is per configuration).
Workloads: see jaxlm/benchmarks/workload.py. The host's speed drifts: compare figures from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxlm.benchmarks import bucket_engine  # noqa: E402  (what runs inside the engine processes)
from jaxlm.benchmarks.workload import Workload, load_workload, synthetic_spec_within  # noqa: E402
from jaxlm.config import CacheConfig, SchedulerConfig  # noqa: E402
from jaxlm.worker.bucket_planner import derive_buckets, parse_bucket_spec  # noqa: E402


def _model_info(args) -> tuple[int, object, object]:
    """(vocab size, tokenizer) without touching an accelerator (the engine processes own it)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import get_tokenizer, resolve_model_config

    mc = resolve_model_config(ModelConfig(model=args.model), LoadConfig())
    try:
        tok = get_tokenizer(mc)
    except Exception as e:  # noqa: BLE001  synthetic workloads need no tokenizer
        print(f"(no tokenizer: {e})", file=sys.stderr)
        tok = None
    return int(mc.hf_config.vocab_size), tok, mc


def _workload(args, vocab: int, tok, model_len: int) -> Workload:
    """The workload, within the model's context (model_len: its positions, as the engine caps
    them): the default synthetic one is fitted to it (said in one line); another whose requests
    do not fit is refused before anything compiles, unless --max-model-len asks to drop them."""
    if args.max_model_len and args.max_model_len > model_len:
        raise ValueError(f"--max-model-len {args.max_model_len} is more than the model's {model_len} positions")
    limit = args.max_model_len or model_len
    wl = load_workload(args.workload, vocab, args.output_len, args.num_requests).tokenized(tok)
    if wl.max_total_len() > limit:
        if args.workload == "synthetic":
            spec = synthetic_spec_within(limit)
            print(f"the default workload's requests need up to {wl.max_total_len()} tokens and the model holds "
                  f"{limit}: running {spec} instead", flush=True)
            wl = load_workload(spec, vocab, args.output_len, args.num_requests).tokenized(tok)
        elif args.max_model_len:
            wl = wl.fitting(limit)  # as asked: the requests that do not fit are dropped (logged)
        else:
            n = sum(len(r.prompt_token_ids) + r.output_len > limit for r in wl.requests)
            raise ValueError(f"workload {wl.name}: {n} of {len(wl.requests)} requests need more than the model's "
                             f"{limit} tokens (up to {wl.max_total_len()}); pass --max-model-len {limit} to drop them")
    return wl.with_request_rate(args.request_rate, args.seed)


def _engine_kwargs(args, wl: Workload) -> dict:
    max_len = args.max_model_len or -(-wl.max_total_len() // 16) * 16
    # The synchronous loop by default: the one the bucket planner simulates (its planned padding
    # is compared with what runs); --async-scheduling measures the engine's default loop.
    return dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=args.async_scheduling)


def _resolve_config(name: str, args, eng: dict, wl: Workload) -> dict:
    sched = SchedulerConfig(max_num_seqs=eng["max_num_seqs"], max_num_batched_tokens=eng["max_num_batched_tokens"],
                            max_model_len=eng["max_model_len"])
    if name == "auto":
        plan = derive_buckets(wl.requests, sched, CacheConfig(), args.max_programs,
                              step_seconds=args.sim_step_seconds)
        print(f"auto buckets ({plan.num_programs} programs, simulated padding "
              f"{plan.expected_waste['tokens']:.1%} of tokens): {plan.as_flags()}", flush=True)
        return {"name": name, "token_buckets": plan.token_buckets, "seq_buckets": plan.seq_buckets,
                "flags": plan.as_flags(), "planned_waste": plan.expected_waste}
    tokens, seqs = parse_bucket_spec(name, sched.max_num_batched_tokens, sched.max_num_seqs)
    return {"name": name, "token_buckets": tokens, "seq_buckets": seqs}


def _child(spec: dict, workdir: str) -> dict:
    """Runs jaxlm/benchmarks/bucket_engine.py on `spec` in a fresh process; its JSON result."""
    fd, spec_path = tempfile.mkstemp(suffix=".json", dir=workdir)
    out_path = spec_path + ".out"
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, "-m", "jaxlm.benchmarks.bucket_engine", spec_path, out_path])
    if proc.returncode != 0:
        raise RuntimeError(f"the engine process for {spec['label']!r} failed (exit {proc.returncode})")
    with open(out_path) as f:
        return json.load(f)


def run_config(cfg: dict, args, eng: dict, wl_path: str, workdir: str, roofline: bool) -> dict:
    # A fresh cache per configuration, so the cold warm-up really is cold (unless --compile-cache).
    fresh = args.compile_cache is None
    cache_dir = tempfile.mkdtemp(prefix="xla_cache_", dir=workdir) if fresh else args.compile_cache
    base = {"label": cfg["name"], "workload": wl_path,
            "engine": dict(eng, token_buckets=cfg["token_buckets"], seq_buckets=cfg["seq_buckets"],
                           compilation_cache_dir=None if cache_dir == "default" else cache_dir)}
    res = dict(cfg)
    if args.cold:
        res["warmup_cold_s"] = _child(dict(base, phase="warmup"), workdir)["warmup_s"]
    served = _child(dict(base, phase="serve", roofline=roofline), workdir)
    res["warmup_cached_s" if args.cold else "warmup_cold_s"] = served.pop("warmup_s")
    res.update(served)
    if fresh:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return res


def _fmt_ms(r: dict, name: str) -> str:
    return f"{r[f'median_{name}_ms']:.0f}/{r[f'p99_{name}_ms']:.0f}"


def print_table(results: list[dict], hf: dict | None) -> None:
    w0 = max([14] + [len(r["name"]) + 2 for r in results])
    head = (f"{'config':<{w0}}{'progs':>6}{'warm cold s':>12}{'warm cache s':>13}{'pad tok/row/page/samp %':>25}"
            f"{'out tok/s':>10}{'TTFT p50/p99 ms':>17}{'TPOT p50/p99 ms':>17}{'RSS MB':>8}{'dev MB':>8}")
    print(head)
    for r in results:
        w = r["padding_waste"]
        pad = "/".join(f"{100 * w[k]:.1f}" for k in ("tokens", "rows", "pages", "samples"))
        cached = f"{r['warmup_cached_s']:.1f}" if "warmup_cached_s" in r else "-"
        dev = f"{r['peak_device_mb']:.0f}" if r.get("peak_device_mb") else "-"
        print(f"{r['name']:<{w0}}{r['programs']:>6}{r['warmup_cold_s']:>12.1f}{cached:>13}{pad:>25}"
              f"{r['output_throughput']:>10.1f}{_fmt_ms(r, 'ttft'):>17}{_fmt_ms(r, 'tpot'):>17}"
              f"{r['peak_rss_mb']:>8.0f}{dev:>8}")
    if hf:
        print(f"{'transformers':<{w0}}{'':>6}{'':>12}{'':>13}{'':>25}{hf['output_throughput']:>10.1f}"
              f"{'':>17}{'':>17}{hf['peak_rss_mb']:>8.0f}{'':>8}")
        for r in results:
            print(f"  {r['name']}: {r['output_throughput'] / hf['output_throughput']:.2f}x transformers' output tok/s")
    for r in results:
        if "flags" in r:
            print(f"  {r['name']} = {r['flags']}")


def print_roofline(rf: dict) -> None:
    print(f"roofline ({rf['device']}): memory bandwidth {rf['bandwidth_gb_s']:.1f} GB/s, "
          f"matmul {rf['matmul_gflop_s']:.1f} GFLOP/s (measured with jax)")
    print(f"  batch-1 decode {rf['b1_decode_tok_s']:.1f} tok/s = {rf['b1_pct_of_bandwidth_bound']:.0%} of the "
          f"bandwidth bound {rf['b1_bandwidth_bound_tok_s']:.1f} tok/s "
          f"({rf['bytes_per_token'] / 1e6:.0f} MB read a token)")
    print(f"  batched run {rf['batched_gflop_s']:.1f} GFLOP/s = {rf['batched_pct_of_compute_bound']:.1%} of the "
          f"matmul bound")


def plot(results: list[dict], hf: dict | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results] + (["transformers"] if hf else [])
    tput = [r["output_throughput"] for r in results] + ([hf["output_throughput"]] if hf else [])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(names, tput, color=["C0"] * len(results) + ["C3"] * bool(hf))
    a.set_ylabel("output tokens/s")
    a.set_title("throughput")
    x = np.arange(len(results))
    for i, key in enumerate(["median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"]):
        b.bar(x + (i - 1.5) * 0.2, [r[key] for r in results], 0.2, label=key)
    b.set_xticks(x, [r["name"] for r in results])
    b.set_yscale("log")
    b.set_ylabel("ms")
    b.set_title("latency")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def bench_vs_hf(args, wl: Workload, mc) -> dict:
    """The same requests through transformers' batched generate on the same weights (float32)."""
    import resource

    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 2)
    path = mc.model
    if path.endswith(".gguf"):
        path = bucket_engine.gguf_as_safetensors(path, args.workdir)  # the dequantized weights jaxlm runs
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reqs = sorted(wl.requests, key=lambda r: len(r.prompt_token_ids))
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(reqs), args.hf_batch):
            batch = reqs[i:i + args.hf_batch]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):  # left padding, as batched generate wants
                ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[j, width - len(r.prompt_token_ids):] = 1
            n_new = max(r.output_len for r in batch)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new,
                           min_new_tokens=n_new, pad_token_id=0)
    elapsed = time.perf_counter() - t0
    # Only the tokens each request asked for count; the rest of its batch's length is waste.
    n_out = sum(r.output_len for r in wl.requests)
    return {"output_throughput": n_out / elapsed, "duration": elapsed, "batch": args.hf_batch,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _save_workload(wl: Workload, path: str) -> None:
    with open(path, "w") as f:
        json.dump([{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len,
                    "arrival_time": r.arrival_time} for r in wl.requests], f)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the engine's, SmolLM2 GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", default="synthetic",
                   help="synthetic[:num=,prompt=LO-HI,output=LO-HI,seed=], a .jsonl or a ShareGPT .json")
    p.add_argument("--num-requests", type=int, default=None, help="first N requests of the workload")
    p.add_argument("--output-len", type=int, default=128, help="output length where the workload gives none")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals/s (inf: offline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--buckets", nargs="+", default=["pow2"], help="bucket configs to compare")
    p.add_argument("--max-programs", type=int, default=40, help="compiled-program budget of 'auto'")
    p.add_argument("--sim-step-seconds", type=float, default=None,
                   help="step time 'auto' assumes to place arrivals (default: all arrive at once)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--async-scheduling", action="store_true",
                   help="serve with async scheduling (default: the synchronous loop the planner simulates)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the workload's longest request")
    p.add_argument("--no-cold", dest="cold", action="store_false",
                   help="skip the cold warm-up process (warm-up is then measured once, cold)")
    p.add_argument("--compile-cache", default=None,
                   help="persistent compile cache to use and keep ('default': the engine's; default: a fresh "
                        "one per config)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--plot", help="write a throughput/latency chart here (needs matplotlib)")
    p.add_argument("--vs-hf", action="store_true", help="also run transformers' batched generate")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers generate batch size")
    p.add_argument("--roofline", action="store_true", help="report against measured bandwidth/matmul limits")
    p.add_argument("--sampling", action="store_true", help="decode with every sampling filter on vs greedy")
    p.add_argument("--structured", action="store_true", help="decode under a JSON schema vs none")
    p.add_argument("--host-overhead", action="store_true",
                   help="ms per decode step of a tiny model at batch 1/8/64, by part, sync and async scheduling")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help="compare speculative decoding (vLLM's JSON object) with none (jaxlm/benchmarks/spec_decode.py)")
    p.add_argument("--spec-workload", choices=("copy", "novel", "random", "mixed"), default="copy")
    p.add_argument("--spec-batch", type=int, default=1, help="max_num_seqs of the speculative comparison")
    p.add_argument("--spec-also", type=json.loads, nargs="*", default=[],
                   help="more speculating engines: fields over --speculative-config, e.g. '{\"disable_by_batch_size\": 16}'")
    p.add_argument("--spec-reps", type=int, default=3,
                   help="runs of each engine, in turn (medians); 0 builds the engines only (warms the compile caches)")
    p.add_argument("--spec-off-sync", action="store_true",
                   help="also the engine without speculation under synchronous scheduling (as a speculating step runs)")
    p.add_argument("--lora-modules", nargs="*", default=None, metavar="NAME=PATH",
                   help="LoRA figures with these adapters (none given: random ones of --lora-rank)")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the random adapters (and max_lora_rank)")
    p.add_argument("--lora-delta", action="store_true", help="time the LoRA delta's candidate forms")
    p.add_argument("--moe", action="store_true",
                   help="synthetic MoE (hidden 512, 4 layers, top-2): batch-64 decode step at 64 vs 8 experts, "
                        "per-device bytes at EP=4; then the usual run (and --vs-hf) on the 64-expert model")
    p.add_argument("--moe-expert-size", type=int, default=512, help="--moe: intermediate size of one expert")
    p.add_argument("--moe-vocab", type=int, default=8192, help="--moe: vocabulary size")
    p.add_argument("--prefill", action="store_true",
                   help="prefill tok/s by prompt length beside transformers, a cached-prefix suffix beside fresh")
    p.add_argument("--prefill-lens", default="128,256,500,1500", help="--prefill: prompt lengths")
    p.add_argument("--prefill-reps", type=int, default=5, help="--prefill: runs per length (median)")
    p.add_argument("--prefill-profile", default="", metavar="N,...",
                   help="--prefill: also profile the steps of an N-token prompt op by op")
    p.add_argument("--prefix-len", type=int, default=1400, help="--prefill: the cached prefix")
    p.add_argument("--suffix-len", type=int, default=100, help="--prefill: the suffix after it")
    p.add_argument("--workdir", default="/tmp/jaxlm_bench", help="scratch space (compile caches, GGUF export)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    if args.host_overhead:
        from jaxlm.benchmarks import host_overhead

        host_overhead.bench_host_overhead(async_modes=(False, True))
        return
    if args.structured:
        bucket_engine.bench_structured(args.model, args.dtype)
        return
    if args.lora_modules is not None or args.lora_delta:
        from jaxlm.benchmarks import lora as bench_lora
        from jaxlm.lora.module_path import parse_lora_module

        if args.lora_delta:
            bench_lora.bench_delta()
        if args.lora_modules is not None:
            modules = [(m.name, m.path) for m in map(parse_lora_module, args.lora_modules)]
            bench_lora.bench_lora(args.model, args.dtype, modules, args.lora_rank, workdir=args.workdir)
        return
    if args.prefill:
        from jaxlm.benchmarks import prefill as bench_prefill
        ints = lambda s: [int(n) for n in s.split(",") if n]  # noqa: E731
        bench_prefill.bench_prefill(args.model, ints(args.prefill_lens), args.prefill_reps, ints(args.prefill_profile),
                                    args.prefix_len, args.suffix_len, args.workdir, args.json, args.max_num_seqs,
                                    args.max_num_batched_tokens)
        return
    if args.sampling:
        bucket_engine.bench_sampling(args.model, args.dtype)
        return
    if args.speculative_config is not None:
        from jaxlm.benchmarks import spec_decode as bench_spec
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
        print(f"CPU {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()}", flush=True)
        res = bench_spec.bench_spec(args.model, args.speculative_config, args.spec_workload, args.spec_batch,
                                    args.spec_also, args.spec_reps, args.dtype, args.spec_off_sync)
        print(f"load average after: {os.getloadavg()}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return
    if args.moe:
        from jaxlm.benchmarks import moe as bench_moe
        args.model = bench_moe.run(args)
    vocab, tok, mc = _model_info(args)
    try:
        wl = _workload(args, vocab, tok, mc.max_model_len)
    except ValueError as e:  # one line, before anything compiles
        sys.exit(f"bench.py: {e}")
    eng = _engine_kwargs(args, wl)
    print(f"workload {wl.name}: {len(wl.requests)} requests; engine {eng}", flush=True)
    configs = [_resolve_config(name, args, eng, wl) for name in args.buckets]
    wl_path = os.path.join(args.workdir, "workload.json")
    _save_workload(wl, wl_path)
    results = [run_config(cfg, args, eng, wl_path, args.workdir, args.roofline and i == 0)
               for i, cfg in enumerate(configs)]
    hf = bench_vs_hf(args, wl, mc) if args.vs_hf else None
    print_table(results, hf)
    rf = results[0].pop("roofline", None)
    if rf:
        print_roofline(rf)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": wl.name, "num_requests": len(wl.requests), "request_rate": args.request_rate,
                       "engine": eng, "configs": results, "transformers": hf, "roofline": rf}, f, indent=2)
    if args.plot:
        plot(results, hf, args.plot)


if __name__ == "__main__":
    main()
