"""`jaxlm bench serve` and guidellm (0.8.x) results side by side, on vLLM's definitions.

    python scripts/dev/compare_guidellm.py JAXLM.json GUIDELLM.json [JAXLM2.json GUIDELLM2.json ...]

JAXLM.json: `jaxlm bench serve ... --save-result --save-detailed`; GUIDELLM.json: `guidellm run
... --output kind=json,path=GUIDELLM.json`. Pairs are rounds; the last lines are the medians of
the per-round ratios. guidellm's own figures are recomputed from its per-request records where its
definitions differ from vLLM's:
- its `time_per_output_token_ms` is latency / output tokens (TTFT included); vLLM's TPOT is
  (latency - TTFT) / (output tokens - 1), which is guidellm's `inter_token_latency_ms`;
- its medians are the lower median (the value where the CDF reaches 0.5), numpy's the midpoint.
Its output tok/s (`output_tokens_per_second` mean) is its output tokens over its duration, first
request sent -> last answered (warm-up and cool-down are off unless asked for): vLLM's.
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np


def jaxlm_round(path: str) -> dict:
    d = json.load(open(path))
    out = {"tok_s": d["output_throughput"], "ttft": d["median_ttft_ms"], "tpot": d["median_tpot_ms"],
           "dur": d["duration"], "n": d["completed"], "out": d["total_output_tokens"], "in": d["total_input_tokens"]}
    if "itls" in d:  # chunks the client read back to back would show as near-zero gaps
        gaps = np.concatenate([np.asarray(i, dtype=float) for i in d["itls"] if i] or [np.zeros(0)])
        out["gaps_under_20ms"] = f"{int((gaps < 0.02).sum())}/{gaps.size}"
    return out


def guidellm_round(path: str) -> dict:
    b = json.load(open(path))["benchmarks"][0]
    m, reqs = b["metrics"], b["requests"]["successful"]
    ttft = [r["time_to_first_token_ms"] for r in reqs]
    tpot = [(r["request_latency"] * 1e3 - r["time_to_first_token_ms"]) / (r["output_tokens"] - 1)
            for r in reqs if r["output_tokens"] > 1]
    return {"tok_s": m["output_tokens_per_second"]["successful"]["mean"], "ttft": float(np.median(ttft)),
            "tpot": float(np.median(tpot)), "dur": b["duration"], "n": len(reqs),
            "out": sum(r["output_tokens"] for r in reqs), "in": sum(r["prompt_tokens"] for r in reqs),
            "own_ttft_p50": m["time_to_first_token_ms"]["successful"]["median"],
            "own_tpot_p50": m["time_per_output_token_ms"]["successful"]["median"],
            "warmup_s": b["warmup_duration"], "cooldown_s": b["cooldown_duration"]}


def main(paths: list[str]) -> None:
    if not paths or len(paths) % 2:
        sys.exit(__doc__)
    ratios = []
    for i in range(0, len(paths), 2):
        a, g = jaxlm_round(paths[i]), guidellm_round(paths[i + 1])
        r = {k: a[k] / g[k] for k in ("tok_s", "ttft", "tpot", "dur")}
        ratios.append(r)
        print(f"round {i // 2 + 1}")
        print(f"  jaxlm    out tok/s {a['tok_s']:7.2f}  median TTFT {a['ttft']:8.0f} ms  median TPOT {a['tpot']:6.1f} ms  "
              f"duration {a['dur']:6.1f} s  {a['n']} requests, {a['in']} in / {a['out']} out tokens  "
              f"gaps < 20 ms: {a.get('gaps_under_20ms', '-')}")
        print(f"  guidellm out tok/s {g['tok_s']:7.2f}  median TTFT {g['ttft']:8.0f} ms  median TPOT {g['tpot']:6.1f} ms  "
              f"duration {g['dur']:6.1f} s  {g['n']} requests, {g['in']} in / {g['out']} out tokens  "
              f"(its own p50 TTFT {g['own_ttft_p50']:.0f} ms, its own 'TPOT' {g['own_tpot_p50']:.1f} ms; "
              f"warm-up {g['warmup_s']} s, cool-down {g['cooldown_s']} s)")
        print("  jaxlm / guidellm: " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()))
    print("median of the per-round ratios: " + "  ".join(
        f"{k} {statistics.median(r[k] for r in ratios):.3f}" for k in ratios[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
