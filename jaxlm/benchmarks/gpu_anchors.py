"""The anchors scripts/gpu_check.py measures, one function per part (each runs in its own process).

  decode_variant    ITL at batch 1 and 8 and decode tok/s of one engine variant: XLA's default
                    command buffers, cudagraph_mode NONE / FULL_DECODE_ONLY, fp8 KV cache, online
                    fp8 weights; with how many command buffers the decode body holds
  nano_vllm         nano-vllm's bench.py workload (256 sequences, prompt and output lengths
                    uniform in 100-1,024, seed 0, random token ids, ignore_eos, temperature 0.6)
                    on a Qwen3-0.6B-shaped random bf16 checkpoint, beside the published figures
  hf_generate       transformers' generate on the SmolLM2-shaped checkpoint, batch 1 and 64
  serve_load        `jaxlm bench serve` against `python -m jaxlm.serve` at concurrency 1, 16, 64
  prefill           prefill tok/s at 512, 2,048 and 8,192 prompt tokens

Every part takes (fig, workdir, smoke): `fig.put(key, value)` records a figure as soon as it is
known (a part cut by its time box keeps what it put); smoke: CPU, tiny shapes, figures that mean
nothing. Checkpoints are random (transformers' init), built here: nothing is downloaded.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

# SmolLM2-135M's shape (config.json of HuggingFaceTB/SmolLM2-135M); positions up to 16k so the
# prefill part can run 8,192-token prompts on it (the weights do not depend on it).
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
               eos_token_id=2, pad_token_id=2)
# Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
# Published on other cards (not a same-run ratio): the README figures of vLLM and nano-vllm.
NANO_VLLM_PUBLISHED = {"vllm_0.10.2_A800-SXM4-80GB": 8588, "nano-vllm_A100": 8670, "vllm_A100-80GB-PCIe": 9530}
# One engine configuration for the SmolLM2 decode figures and the server: the same programs,
# so the server's start loads the decode part's from the program cache (KV blocks pinned).
SMOL_ENGINE = dict(dtype="bfloat16", max_num_seqs=64, max_model_len=512, max_num_batched_tokens=1024,
                   token_buckets=[1, 64, 1024], seq_buckets=[1, 64], num_gpu_blocks_override=2048)
SMOL_ENGINE_SMOKE = dict(SMOL_ENGINE, max_num_seqs=8, token_buckets=[1, 8, 1024], seq_buckets=[1, 8],
                         num_gpu_blocks_override=256)
# The variants' engine: few programs (4 bodies, 6 samplers) so that five of them fit the run.
VARIANT_ENGINE = dict(dtype="bfloat16", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256,
                      token_buckets=[8, 256], seq_buckets=[8], num_gpu_blocks_override=256)
VARIANTS = {
    "default": {},  # XLA's default command buffers
    "cg_none": {"compilation_config": {"cudagraph_mode": "NONE"}},
    "cg_full_decode": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    "kv_fp8": {"kv_cache_dtype": "fp8"},
    "w_fp8": {"quantization": "fp8"},
}


def random_checkpoint(path: str, shape: dict[str, Any], arch: str, layers: int | None = None,
                      **small: Any) -> str:
    """A random bf16 safetensors checkpoint of `shape` (transformers' init, seed 0) with the tests'
    byte tokenizer; kept when it exists (parts share it)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    from tests.helpers.tiny_tokenizer import write_byte_tokenizer

    cfg = {**shape, **small}
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    config = getattr(transformers, arch)(**cfg)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    write_byte_tokenizer(path, vocab_size=cfg["vocab_size"])  # every id has text (the server part counts it)
    return path


def smollm2(workdir: str, smoke: bool) -> str:
    return random_checkpoint(os.path.join(workdir, "smollm2"), SMOLLM2, "LlamaConfig", 2 if smoke else None)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab - 3, length).tolist()} for _ in range(n)]


def itl_ms(outs: list) -> float:
    """Median over requests of the ms between a request's first and last token per token."""
    per = [(o.metrics.last_token_ts - o.metrics.first_token_ts) / (len(o.outputs[0].token_ids) - 1)
           for o in outs if len(o.outputs[0].token_ids) > 1]
    return 1e3 * statistics.median(per)


def command_buffer_counts(compiled: Any) -> dict[str, int]:
    """In the optimized HLO of a compiled program: command-buffer calls in the entry computation,
    and Triton (Pallas) calls left in it, outside any command buffer."""
    text = compiled.as_text()
    entry, inside = [], False
    for line in text.splitlines():
        inside = inside or line.startswith("ENTRY")
        if inside:
            entry.append(line)
            if line.startswith("}"):
                break
    triton = ("__gpu$xla.gpu.triton", "triton_kernel_call")
    return {"command_buffers": sum("command_buffer" in ln for ln in entry),
            "triton_calls_outside": sum(any(t in ln for t in triton) for ln in entry),
            "triton_calls": sum(any(t in ln for t in triton) for ln in text.splitlines())}


def decode_variant(name: str, fig: Any, workdir: str, smoke: bool) -> None:
    """One VARIANTS engine on the SmolLM2 shape: ITL at batch 1 and 8, decode tok/s at batch 8."""
    from jaxlm import LLM, SamplingParams

    llm = LLM(model=smollm2(workdir, smoke), **VARIANT_ENGINE, **VARIANTS[name])
    runner = llm.llm_engine.get_model_runner()
    fig.put("programs", runner.num_programs)
    fig.put("warmup_s", round(runner.warmup_seconds, 1))
    body = runner._body.get((8, "decode")) or runner._body.get((8, "mixed"))
    try:  # what XLA made of the mode (on CPU: no command buffers at all)
        fig.put("decode_body_hlo", command_buffer_counts(body))
        print(f"  [{name}] decode body: {fig.data['decode_body_hlo']}", flush=True)
    except Exception as e:  # noqa: BLE001 - a loaded executable may have no text: the figures go on
        fig.put("decode_body_hlo", f"{type(e).__name__}: {e}"[:200])
    out_len = 8 if smoke else 64
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, detokenize=False)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    for b in (1, 8):
        prompts = _prompts(b, 64, vocab, b)
        llm.generate(prompts, params, use_tqdm=False)  # warm
        outs = llm.generate(prompts, params, use_tqdm=False)
        fig.put(f"itl_ms_b{b}", round(itl_ms(outs), 3))
        span = max(o.metrics.last_token_ts for o in outs) - min(o.metrics.first_token_ts for o in outs)
        fig.put(f"decode_tok_s_b{b}", round(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / span, 1))
        print(f"  [{name}] batch {b}: {fig.data[f'itl_ms_b{b}']:.3f} ms a token (median over requests), "
              f"decode {fig.data[f'decode_tok_s_b{b}']:,.0f} tok/s", flush=True)
    fig.put("compiles_after_warmup", runner.num_compiles_after_warmup)
    llm.llm_engine.shutdown()


def nano_vllm(fig: Any, workdir: str, smoke: bool) -> None:
    """nano-vllm's bench.py, as it draws the workload (Python's random, seed 0: prompts first,
    then the output lengths; 133,966 output tokens at 256 sequences)."""
    from random import randint, seed

    from jaxlm import LLM, SamplingParams

    num, lo, hi = (4, 10, 40) if smoke else (256, 100, 1024)
    path = random_checkpoint(os.path.join(workdir, "qwen3_0_6b"), QWEN3_0_6B, "Qwen3Config",
                             **(dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16) if smoke else {}))
    seed(0)
    prompts = [{"prompt_token_ids": [randint(0, 10000) for _ in range(randint(lo, hi))]} for _ in range(num)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(lo, hi)) for _ in range(num)]
    t0 = time.perf_counter()
    llm = LLM(model=path, dtype="bfloat16", max_num_seqs=num, max_model_len=2 * hi,
              max_num_batched_tokens=8192 if not smoke else 256,
              token_buckets=[256, 2048, 8192] if not smoke else [16, 64, 256],
              seq_buckets=[64, 256] if not smoke else [4])
    fig.put("engine_up_s", round(time.perf_counter() - t0, 1))
    fig.put("programs", llm.llm_engine.get_model_runner().num_programs)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=4), use_tqdm=False)  # nano-vllm's warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    total = sum(p.max_tokens for p in params)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == total, "ignore_eos: every sequence runs to max_tokens"
    fig.put("output_tokens", total)
    fig.put("generate_s", round(elapsed, 2))
    fig.put("tok_s", round(total / elapsed, 1))
    fig.put("published_other_cards_tok_s", NANO_VLLM_PUBLISHED)
    print(f"  {num} sequences, {total:,} output tokens in {elapsed:.2f} s: {total / elapsed:,.0f} tok/s "
          f"(published, other cards, not a same-run ratio: " +
          ", ".join(f"{k} {v:,}" for k, v in NANO_VLLM_PUBLISHED.items()) + ")", flush=True)
    llm.llm_engine.shutdown()


def hf_generate(fig: Any, workdir: str, smoke: bool) -> None:
    """transformers' greedy generate (eager, bf16 on the GPU), 128 in / 64 out, batch 1 and 64:
    output tok/s over the whole call, as gpu_check's jaxlm e2e figures."""
    import torch
    import transformers

    device = "cpu" if smoke else "cuda"
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2(workdir, smoke), dtype=torch.bfloat16).to(device)
    in_len, out_len = (8, 4) if smoke else (128, 64)
    for b in (1, 2) if smoke else (1, 64):
        ids = torch.tensor([p["prompt_token_ids"] for p in _prompts(b, in_len, SMOLLM2["vocab_size"], b)],
                           device=device)
        kw = dict(do_sample=False, pad_token_id=2, attention_mask=torch.ones_like(ids))
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        rate = b * (out.shape[1] - in_len) / (time.perf_counter() - t0)
        fig.put(f"e2e_tok_s_b{b}", round(rate, 1))
        print(f"  transformers {transformers.__version__} generate, batch {b}: {rate:,.1f} tok/s "
              f"({in_len} in, {out_len} out, bf16, eager)", flush=True)


def serve_load(fig: Any, workdir: str, smoke: bool, port: int = 8765) -> None:
    """The server (SMOL_ENGINE's flags) under `jaxlm bench serve` at concurrency 1, 16, 64."""
    import argparse
    import asyncio
    import urllib.request

    from jaxlm.benchmarks import serve as bench_serve

    eng = SMOL_ENGINE_SMOKE if smoke else SMOL_ENGINE
    flags = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in eng.items()]
    cmd = [sys.executable, "-m", "jaxlm.serve", smollm2(workdir, smoke), "--port", str(port),
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *flags]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} before /health answered")
            time.sleep(0.5)
        fig.put("health_s", round(time.perf_counter() - t0, 1))
        for conc, num in ((1, 4), (2, 4)) if smoke else ((1, 16), (16, 64), (64, 128)):
            p = argparse.ArgumentParser()
            bench_serve.add_cli_args(p)
            args = p.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "random",
                                 "--random-input-len", "8" if smoke else "128",
                                 "--random-output-len", "4" if smoke else "64", "--num-prompts", str(num),
                                 "--max-concurrency", str(conc), "--metric-percentiles", "50,90,99",
                                 "--num-warmups", "1", "--disable-tqdm"])
            res = asyncio.run(bench_serve.benchmark(args))
            keep = {k: round(v, 3) for k, v in res.items() if isinstance(v, float) and
                    any(m in k for m in ("ttft", "itl", "tpot", "output_throughput"))}
            keep["failed"] = res["failed"]
            fig.put(f"concurrency_{conc}", keep)
            print(f"  concurrency {conc}: {res['output_throughput']:,.0f} output tok/s, TTFT p50 "
                  f"{res.get('median_ttft_ms', float('nan')):.1f} ms p99 {res.get('p99_ttft_ms', float('nan')):.1f} ms, "
                  f"ITL p50 {res.get('median_itl_ms', float('nan')):.2f} ms p99 "
                  f"{res.get('p99_itl_ms', float('nan')):.2f} ms ({res['failed']} failed)", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()


def prefill(fig: Any, workdir: str, smoke: bool) -> None:
    """Prompt tokens/s of one fresh prompt of 512, 2,048 and 8,192 tokens (a 1-token generate:
    the prefill and one sampler call), median of 3."""
    from jaxlm import LLM, SamplingParams

    lens = [32, 64, 128] if smoke else [512, 2048, 8192]
    llm = LLM(model=smollm2(workdir, smoke), dtype="bfloat16", max_num_seqs=1, max_model_len=lens[-1] + 16,
              max_num_batched_tokens=lens[-1], token_buckets=lens, seq_buckets=[1])
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    for i, n in enumerate(lens):
        times = []
        for rep in range(4):  # the first is a warm-up
            [p] = _prompts(1, n, vocab, 100 * i + rep)  # fresh tokens: no prefix-cache hit
            t0 = time.perf_counter()
            llm.generate([p], one, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        rate = n / statistics.median(times[1:])
        fig.put(f"tok_s_{n}", round(rate, 1))
        print(f"  prefill {n:>5} tokens: {rate:,.0f} tok/s", flush=True)
    llm.llm_engine.shutdown()
