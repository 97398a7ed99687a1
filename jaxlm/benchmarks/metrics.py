"""Per-request timings into `vllm bench serve`'s result keys, and its printed summary.

One place computes the serving figures, whoever measured the requests: `jaxlm bench serve`
(chunk arrival times on the client), scripts/bench.py's engine processes (the engine's own
per-request timestamps). Definitions as vLLM's:

- TTFT: request sent -> first chunk with text; E2EL: request sent -> last chunk;
- ITL: the gaps between successive chunks after the first (every gap of every request);
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one output token;
- throughputs divide by the benchmark's duration (first request sent -> last one done).

Keys: duration, completed, failed, total_input_tokens, total_output_tokens, request_throughput,
output_throughput, total_token_throughput, max_output_tokens_per_s, max_concurrent_requests, and
for each metric of --percentile-metrics: mean_/median_/std_ and p{N}_ of --metric-percentiles,
in ms (`mean_ttft_ms`, `p99_itl_ms`, ...).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
_HEADERS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
            "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclasses.dataclass
class RequestOutcome:
    """One request's timings, in seconds; start_time on the benchmark's own clock."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    generated_text: str = ""


def parse_percentile_args(metrics: str | None, percentiles: str) -> tuple[list[str], list[float]]:
    """--percentile-metrics and --metric-percentiles, checked (ValueError naming the bad item)."""
    names = [m.strip() for m in (metrics or DEFAULT_PERCENTILE_METRICS).split(",") if m.strip()]
    bad = [m for m in names if m not in PERCENTILE_METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(bad)} (choose from {', '.join(PERCENTILE_METRICS)})")
    try:
        ps = [float(p) for p in percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {percentiles!r}: expected numbers like 50,90,99") from None
    if any(not 0 <= p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles {percentiles!r}: each must be within 0..100")
    return names, ps


def metric_stats(name: str, seconds: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/p{N} of one metric in ms, keyed as vLLM writes them (0 when empty)."""
    ms = np.asarray(seconds or [0.0], dtype=np.float64) * 1e3
    out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _peaks(ok: list[RequestOutcome]) -> tuple[float, int]:
    """(most output tokens in one wall-clock second, most requests in flight during that second)."""
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    end = max(o.start_time + o.latency for o in ok)
    n = max(1, math.ceil(end - t0))
    tokens, in_flight = np.zeros(n), np.zeros(n, dtype=np.int64)
    for o in ok:
        t = o.start_time + o.ttft
        stamps = [t]
        for gap in o.itl:
            t += gap
            stamps.append(t)
        for s in stamps:
            tokens[min(n - 1, int(s - t0))] += 1
        lo, hi = int(o.start_time - t0), min(n - 1, int(o.start_time + o.latency - t0))
        in_flight[lo:hi + 1] += 1
    peak = int(np.argmax(tokens))
    return float(tokens[peak]), int(in_flight[peak])


def calculate_metrics(outcomes: list[RequestOutcome], duration: float, selected: list[str],
                      percentiles: list[float]) -> dict[str, Any]:
    """The result dictionary (see the module docstring) over every request sent."""
    ok = [o for o in outcomes if o.success]
    n_in = sum(o.prompt_len for o in ok)
    n_out = sum(o.output_tokens for o in ok)
    duration = max(duration, 1e-9)
    peak_tok, peak_conc = _peaks(ok)
    res: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(outcomes) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "max_output_tokens_per_s": peak_tok, "max_concurrent_requests": peak_conc,
    }
    values = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1],
        "itl": [gap for o in ok for gap in o.itl],
        "e2el": [o.latency for o in ok],
    }
    for name in selected:
        res.update(metric_stats(name, values[name], percentiles))
    return res


def print_serving_result(res: dict[str, Any], title: str = " Serving Benchmark Result ") -> None:
    """vLLM's summary table: its line titles, in its order."""
    print("{s:{c}^{n}}".format(s=title, n=50, c="="))
    rows = [("Successful requests:", res["completed"]), ("Failed requests:", res["failed"])]
    if res.get("max_concurrency") is not None:
        rows.append(("Maximum request concurrency:", res["max_concurrency"]))
    if res.get("request_rate") not in (None, "inf"):
        rows.append(("Request rate configured (RPS):", f'{res["request_rate"]:.2f}'))
    rows += [("Benchmark duration (s):", f'{res["duration"]:.2f}'),
             ("Total input tokens:", res["total_input_tokens"]),
             ("Total generated tokens:", res["total_output_tokens"]),
             ("Request throughput (req/s):", f'{res["request_throughput"]:.2f}'),
             ("Output token throughput (tok/s):", f'{res["output_throughput"]:.2f}'),
             ("Peak output token throughput (tok/s):", f'{res["max_output_tokens_per_s"]:.2f}'),
             ("Peak concurrent requests:", f'{res["max_concurrent_requests"]:.2f}'),
             ("Total Token throughput (tok/s):", f'{res["total_token_throughput"]:.2f}')]
    for label, value in rows:
        print(f"{label:<40} {value:<10}")
    for name in PERCENTILE_METRICS:
        if f"mean_{name}_ms" not in res:
            continue
        print("{s:{c}^{n}}".format(s=_HEADERS[name], n=50, c="-"))
        for key, value in res.items():
            stat, _, rest = key.partition("_")
            if rest != f"{name}_ms" or stat == "std":
                continue
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            print(f"{f'{label} {name.upper()} (ms):':<40} {value:<10.2f}")
    print("=" * 50)
