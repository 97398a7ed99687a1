#!/usr/bin/env python3
"""Serving benchmark against a running OpenAI-compatible server (like vLLM's benchmark_serving).

Sends --num-prompts streaming requests whose arrivals follow a Poisson process at --request-rate
(req/s; inf = all at once), each a random token-id prompt of --input-len tokens asking for
exactly --output-len tokens (ignore_eos), and prints TTFT, TPOT, inter-token latency and E2E
percentiles plus request and token throughput; --result-json writes `vllm bench serve`'s keys
(mean_ttft_ms, median_ttft_ms, p99_ttft_ms, mean_itl_ms, output_throughput, ...).

    python -m jaxlm.serve &            # SmolLM2 on 127.0.0.1:8000
    python scripts/bench_serve.py --num-prompts 64 --request-rate 4 --input-len 128 --output-len 64

A warm server answers /health before it has loaded every compiled program (it loads the rest
while idle, ~20 s for SmolLM2 on a 2-core CPU, until its log says "all deferred programs
loaded"): time a server after that line, or one started with --no-defer-program-load.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time

import httpx
import numpy as np


@dataclasses.dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Result:
    res = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"]["message"]
                    return res
                if data.get("usage"):
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.output_tokens = data["usage"]["completion_tokens"]
                choices = data.get("choices") or []
                if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.num_prompts, 1))
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        vocab_hi = args.vocab_high
        rng = random.Random(args.seed)
        bodies = []
        for _ in range(args.num_prompts):
            prompt = [rng.randrange(args.vocab_low, vocab_hi) for _ in range(args.input_len)]
            bodies.append({"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        semaphore = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

        async def limited(body: dict) -> Result:
            async with semaphore:
                return await one_request(client, "/v1/completions", body, headers)

        # Warm-up request: not timed (first-use costs should not count).
        if args.warmup:
            await one_request(client, "/v1/completions", dict(bodies[0], max_tokens=2), headers)
        tasks = []
        start = time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, results, duration, model)


def _metric_stats(name: str, seconds: list[float], percentiles: list[float], selected: bool) -> dict:
    """mean/median/std/pNN of one metric in ms, keyed as `vllm bench serve` writes them."""
    if not selected:
        return {}
    ms = np.asarray(seconds or [0.0], dtype=np.float64) * 1e3
    out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(args: argparse.Namespace, results: list[Result], duration: float, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    selected = set(args.percentile_metrics.split(","))
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    summary = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "model_id": model,
        "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "input_lens": [r.prompt_tokens for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot),
                         ("itl", [x for r in ok for x in r.itl]), ("e2el", [r.e2e for r in ok])):
        summary.update(_metric_stats(name, values, percentiles, name in selected))
    return summary


def print_table(s: dict) -> None:
    """The same layout as `vllm bench serve`."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for title, value in (("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
                         ("Benchmark duration (s):", f'{s["duration"]:.2f}'),
                         ("Total input tokens:", s["total_input_tokens"]),
                         ("Total generated tokens:", s["total_output_tokens"]),
                         ("Request throughput (req/s):", f'{s["request_throughput"]:.2f}'),
                         ("Output token throughput (tok/s):", f'{s["output_throughput"]:.2f}'),
                         ("Total Token throughput (tok/s):", f'{s["total_token_throughput"]:.2f}')):
        print(f"{title:<40} {value:<10}")
    for name, header in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                         ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        keys = [k for k in s if k.endswith(f"_{name}_ms") and not k.startswith("std_")]
        if not keys:
            continue
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        for key in keys:
            stat = key.split("_")[0]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            print(f"{f'{label} {name.upper()} (ms):':<40} {s[key]:<10.2f}")
    print("=" * 50)
    for err in sorted({e for e in s["errors"] if e})[:5]:
        print("error:", err)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrival rate, req/s (inf = burst)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab-low", type=int, default=100, help="random prompt token ids are drawn from [low, high)")
    p.add_argument("--vocab-high", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el")
    p.add_argument("--metric-percentiles", default="99", help='comma-separated percentiles, e.g. "25,50,99"')
    p.add_argument("--result-json", default=None, help="also write the summary here (vllm bench serve's keys)")
    args = p.parse_args(argv)
    summary = asyncio.run(run(args))
    print_table(summary)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
