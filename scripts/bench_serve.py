#!/usr/bin/env python3
"""Serving benchmark against a running OpenAI-compatible server (like vLLM's benchmark_serving).

Sends --num-prompts streaming requests whose arrivals follow a Poisson process at --request-rate
(req/s; inf = all at once), each a random token-id prompt of --input-len tokens asking for
exactly --output-len tokens (ignore_eos), and prints TTFT, TPOT, inter-token latency and E2E
percentiles plus request and token throughput.

    python -m jaxlm.serve &            # SmolLM2 on 127.0.0.1:8000
    python scripts/bench_serve.py --num-prompts 64 --request-rate 4 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time

import httpx


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


def percentiles(values: list[float], ps: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, **{f"p{p:g}": 0.0 for p in ps}}
    ordered = sorted(values)
    out = {"mean": statistics.fmean(ordered)}
    for p in ps:  # nearest-rank on the sorted sample, with linear interpolation
        k = (len(ordered) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        out[f"p{p:g}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return out


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


def summarize(args: argparse.Namespace, results: list[Result], duration: float, model: str) -> dict:
    ok = [r for r in results if r.ok]
    ps = [50, 90, 99]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model, "request_rate": args.request_rate, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r.ttft for r in ok], ps).items()},
        "tpot_ms": {k: v * 1e3 for k, v in percentiles(tpot, ps).items()},
        "itl_ms": {k: v * 1e3 for k, v in percentiles([x for r in ok for x in r.itl], ps).items()},
        "e2e_ms": {k: v * 1e3 for k, v in percentiles([r.e2e for r in ok], ps).items()},
    }


def print_table(s: dict) -> None:
    rows = [
        ("Model", s["model"]),
        ("Request rate (req/s)", s["request_rate"]),
        ("Prompts x (input, output) tokens", f'{s["num_prompts"]} x ({s["input_len"]}, {s["output_len"]})'),
        ("Successful / failed requests", f'{s["completed"]} / {s["failed"]}'),
        ("Benchmark duration (s)", f'{s["duration_s"]:.2f}'),
        ("Request throughput (req/s)", f'{s["request_throughput"]:.2f}'),
        ("Output token throughput (tok/s)", f'{s["output_throughput"]:.2f}'),
        ("Total token throughput (tok/s)", f'{s["total_token_throughput"]:.2f}'),
    ]
    for key, title in (("ttft_ms", "Time to first token (ms)"), ("tpot_ms", "Time per output token (ms)"),
                       ("itl_ms", "Inter-token latency (ms)"), ("e2e_ms", "E2E latency (ms)")):
        rows.append((f"{title}: mean / p50 / p90 / p99",
                     " / ".join(f"{s[key][k]:.1f}" for k in ("mean", "p50", "p90", "p99"))))
    width = max(len(k) for k, _ in rows)
    print("=" * (width + 30))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("=" * (width + 30))
    for err in s["errors"]:
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
    p.add_argument("--result-json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    summary = asyncio.run(run(args))
    print_table(summary)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
