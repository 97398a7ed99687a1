"""The engine side of scripts/bench.py: one process per bucket configuration and phase.

    python -m jaxlm.benchmarks.bucket_engine SPEC.json OUT.json

SPEC: {"label", "phase": "warmup" | "serve", "engine": LLM(...) keywords, "workload": path,
"roofline": bool}. "warmup" builds the engine (compiling every program) and reports the warm-up;
"serve" also runs the workload with its arrival times and reports throughput, latency, padding
and memory; with "roofline" it then measures this machine's bandwidth and matmul limits.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

import numpy as np

from jaxlm.benchmarks.metrics import calculate_metrics
from jaxlm.benchmarks.offline import outcomes_from_outputs
from jaxlm.benchmarks.throughput import OFFLINE_METRICS


# Peaks of known accelerators (bytes/s of memory, dense bf16 FLOP/s), reported next to the measured ones.
_SPEC_PEAKS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12), "A100": (2.0e12, 312e12)}


def _peak_device_mb() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return peak / 2**20 if peak else None


def serve_workload(llm, requests: list[dict], label: str) -> dict:
    """Adds each request at its arrival time, steps until all finish; the serving keys of
    jaxlm/benchmarks/metrics.py (request_throughput, output_throughput, *_ttft_ms, *_tpot_ms, ...)."""
    from tqdm import tqdm

    from jaxlm import SamplingParams

    engine = llm.llm_engine
    pending = sorted(enumerate(requests), key=lambda x: x[1]["arrival_time"])[::-1]
    done = []
    bar = tqdm(total=len(requests), desc=f"{label}", unit="req", dynamic_ncols=True)
    start = time.time()
    while pending or engine.has_unfinished_requests():
        now = time.time() - start
        while pending and pending[-1][1]["arrival_time"] <= now:
            i, r = pending.pop()
            params = SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True)
            engine.add_request(f"r{i}", {"prompt_token_ids": r["prompt_token_ids"]}, params,
                               arrival_time=start + r["arrival_time"])
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done.append(out)
                    bar.update(1)
        elif pending:
            time.sleep(min(pending[-1][1]["arrival_time"] - now, 0.05))
    elapsed = time.time() - start
    bar.close()
    # Timed from each request's arrival (as a client times from sending it): vLLM's serving keys.
    outcomes = outcomes_from_outputs(done, start)
    return calculate_metrics(outcomes, elapsed, OFFLINE_METRICS.split(","), [50, 99])


def _median_seconds(fn, reps: int = 5) -> float:
    fn()  # compile + first touch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_limits() -> dict:
    """Memory read bandwidth (a jitted sum) and matmul throughput, measured with jax."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    n = (1 << 28) if gpu else (1 << 26)  # 1 GiB / 256 MiB of float32
    x = jnp.ones(n, jnp.float32)
    total = jax.jit(lambda a: a.sum())
    bw = 4 * n / _median_seconds(lambda: total(x).block_until_ready())
    m = 8192 if gpu else 2048
    dtype = jnp.bfloat16 if gpu else jnp.float32
    a = jnp.ones((m, m), dtype)
    mm = jax.jit(lambda p, q: p @ q)
    flops = 2 * m**3 / _median_seconds(lambda: mm(a, a).block_until_ready())
    out = {"device": dev.device_kind, "bandwidth_gb_s": bw / 1e9, "matmul_gflop_s": flops / 1e9,
           "matmul_dtype": str(np.dtype(dtype))}
    for name, (spec_bw, spec_flops) in _SPEC_PEAKS.items():
        if name in dev.device_kind:
            out.update(spec_bandwidth_gb_s=spec_bw / 1e9, spec_bf16_gflop_s=spec_flops / 1e9)
    return out


def roofline(llm, served: dict, padding) -> dict:
    """Batch-1 decode vs the bandwidth bound; the served run vs the matmul bound."""
    import jax

    from jaxlm import SamplingParams

    runner = llm.llm_engine.get_model_runner()
    hf = llm.llm_engine.model_config.hf_config
    limits = machine_limits()
    weight_bytes = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(runner.params))
    itemsize = runner.kv_caches[0].dtype.itemsize
    spec = runner.kv_cache_spec
    prompt_len = min(128, runner.max_model_len // 2)
    out_len = min(64, runner.max_model_len - prompt_len)
    rng = np.random.default_rng(1)
    rates = []
    for _ in range(3):
        ids = rng.integers(100, runner.vocab_size - 100, prompt_len).tolist()
        [o] = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
        m = o.metrics
        rates.append((len(o.outputs[0].token_ids) - 1) / (m.last_token_ts - m.first_token_ts))
    # Every decode step reads all weights plus the K/V of its context (mean context over the decode).
    kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize * (prompt_len + out_len / 2)
    bytes_per_token = weight_bytes + kv_bytes
    bound = limits["bandwidth_gb_s"] * 1e9 / bytes_per_token
    b1 = statistics.median(rates)
    # FLOPs: 2 per weight per computed token, except the logits matmul, run only for sampled rows.
    params = sum(getattr(x, "size", 0) for x in jax.tree.leaves(runner.params))
    vh = int(hf.vocab_size) * int(hf.hidden_size)
    embeddings = vh if getattr(hf, "tie_word_embeddings", False) else 2 * vh
    flops = 2 * (params - embeddings) * padding.real_tokens + 2 * vh * padding.real_samples
    achieved = flops / served["duration"]
    return dict(limits, weight_bytes=weight_bytes, bytes_per_token=bytes_per_token, b1_decode_tok_s=b1,
                b1_bandwidth_bound_tok_s=bound, b1_pct_of_bandwidth_bound=b1 / bound,
                batched_gflop_s=achieved / 1e9,
                batched_pct_of_compute_bound=achieved / (limits["matmul_gflop_s"] * 1e9))


def run(spec: dict) -> dict:
    from jaxlm import LLM

    llm = LLM(**spec["engine"])
    runner = llm.llm_engine.get_model_runner()
    res = {"programs": runner.num_programs, "warmup_s": runner.warmup_seconds}
    if spec["phase"] == "serve":
        with open(spec["workload"]) as f:
            requests = json.load(f)
        res.update(serve_workload(llm, requests, spec["label"]))
        res["padding_waste"] = runner.padding.waste()
        res["compiles_after_warmup"] = runner.num_compiles_after_warmup
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        res["peak_device_mb"] = _peak_device_mb()
        if spec.get("roofline"):
            res["roofline"] = roofline(llm, res, runner.padding)
    return res


def bench_sampling(model: str | None, dtype: str = "auto", input_len: int = 128, output_len: int = 128) -> None:
    """Decode tok/s with every sampling filter on vs greedy, alternating runs in one engine."""
    from jaxlm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, input_len).tolist()} for _ in range(16)]
    configs = {
        "greedy": SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True),
        "all filters": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                                      frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={100: -2.0},
                                      logprobs=5, seed=0, max_tokens=output_len, ignore_eos=True),
    }
    rates: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(3):
        for name, params in configs.items():
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates[name].append(_decode_tok_s(outs))
    for name, r in rates.items():
        print(f"{name:<12} batch-16 decode tok/s (median of 3): {statistics.median(r):.1f}")
    g, a = statistics.median(rates["greedy"]), statistics.median(rates["all filters"])
    print(f"all filters / greedy: {a / g:.2f}")


def _decode_tok_s(outs) -> float:
    first = min(o.metrics.first_token_ts for o in outs)
    last = max(o.metrics.last_token_ts for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first)


# Long enough to measure decode: 24 strings of up to 16 characters.
_BENCH_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 32},
    "facts": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 24, "maxItems": 24}},
    "required": ["city", "facts"], "additionalProperties": False}


def bench_structured(model: str | None, dtype: str = "auto", input_len: int = 128, output_len: int = 128) -> None:
    """Decode tok/s under a JSON-schema constraint vs none (batch 1 and 16, alternating runs in
    one engine), the schema's compile time, and the host time of the mask fills."""
    from jaxlm import LLM, SamplingParams
    from jaxlm.structured_output import StructuredOutputsParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512)
    engine = llm.llm_engine
    vocab = engine.model_config.hf_config.vocab_size
    t0 = time.perf_counter()
    mgr = engine.get_structured_output_manager()
    print(f"llguidance tokenizer: {time.perf_counter() - t0:.2f} s (once per engine)")
    so = StructuredOutputsParams(json=_BENCH_SCHEMA)
    t0 = time.perf_counter()
    mgr.compile(so)
    print(f"compile the schema: {1e3 * (time.perf_counter() - t0):.2f} ms (then cached)")
    fills: list[tuple[float, int]] = []  # (seconds, rows) of every mask fill in the runner
    fill = mgr.fill_bitmask

    def timed_fill(bitmask, rows):
        t = time.perf_counter()
        fill(bitmask, rows)
        fills.append((time.perf_counter() - t, len(rows)))

    mgr.fill_bitmask = timed_fill
    kw = dict(temperature=0.8, max_tokens=output_len)
    configs = {"none": lambda s: SamplingParams(seed=s, ignore_eos=True, **kw),
               "json schema": lambda s: SamplingParams(seed=s, structured_outputs=so, **kw)}
    rng = np.random.default_rng(0)
    for batch in (1, 16):
        prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, input_len).tolist()} for _ in range(batch)]
        rates: dict[str, list[float]] = {k: [] for k in configs}
        fills.clear()
        for rep in range(3):
            for name, make in configs.items():
                outs = llm.generate(prompts, [make(100 * rep + i) for i in range(batch)], use_tqdm=False)
                rates[name].append(_decode_tok_s(outs))
        line = "  ".join(f"{k}: {statistics.median(r):.1f}" for k, r in rates.items())
        per_row = statistics.median(t / n for t, n in fills)
        per_step = statistics.median(t for t, _ in fills)
        print(f"batch {batch:>2} decode tok/s (median of 3)  {line}  "
              f"ratio {statistics.median(rates['json schema']) / statistics.median(rates['none']):.2f}; "
              f"mask fill per step {1e3 * per_step:.3f} ms, per row {1e3 * per_row:.3f} ms")
    assert engine.get_model_runner().num_compiles_after_warmup == 0


def gguf_as_safetensors(gguf_path: str, workdir: str) -> str:
    """The GGUF's weights, dequantized, as an HF safetensors directory (for transformers)."""
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import get_tokenizer, resolve_model_config
    from jaxlm.model_loader.export import export_safetensors
    from jaxlm.model_loader.gguf_utils import iterate_gguf_weights, open_gguf

    out = os.path.join(workdir, "safetensors")
    if not os.path.isfile(os.path.join(out, "config.json")):
        mc = resolve_model_config(ModelConfig(model=gguf_path), LoadConfig())
        export_safetensors(iterate_gguf_weights(open_gguf(gguf_path), gguf_path), out, mc.hf_config,
                           tokenizer=get_tokenizer(mc))
    return out


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    res = run(spec)
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
