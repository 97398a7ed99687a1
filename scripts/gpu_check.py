"""jaxlm's GPU paths, checked and measured in one run (scripts/gpu_check.sh calls this).

  1. kernels  each Pallas kernel run natively (interpret=False) against its pure-JAX
              reference, on the cases of tests/kernels_pallas/test_kernels.py;
  2. parity   greedy LLM.generate with attention_backend xla and pallas against transformers'
              greedy generate on the same weights (tiny Llama, float32, highest precision);
  3. figures  a SmolLM2-shaped random checkpoint in bfloat16: decode tok/s at batch 1 and
              64, host ms per decode step beside the step's device ms, and the Pallas decode
              kernel's achieved HBM bandwidth beside JAX's bundled kernel
              (`jaxlm bench kernels`).

Checkpoints are built here with transformers (random init, save_pretrained): nothing is
downloaded. Exit status 0 when every check passed, 1 when one failed, 2 without a GPU
(unless --cpu-smoke: the same code on CPU, tiny shapes, kernels in interpret mode, to test
this script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "kernels_pallas")]

# SmolLM2-135M's shape (config.json of HuggingFaceTB/SmolLM2-135M).
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
               eos_token_id=2, pad_token_id=2)


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def check_kernels(interpret: bool) -> list[str]:
    """The kernel tests' cases, natively; returns the failures."""
    import test_kernels as tk

    def forced(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kwargs["interpret"] = interpret
            return fn(*args, **kwargs)
        return call

    tk.paged_decode_attention = forced(tk.paged_decode_attention)
    tk.ragged_paged_attention = forced(tk.ragged_paged_attention)
    failures = []
    cases = [("paged_decode", tk.test_decode_matches_reference, c) for c in tk.DECODE_CASES]
    cases += [("ragged_paged", tk.test_ragged_matches_reference, c) for c in tk.RAGGED_CASES]
    for name, test, case in cases:
        t0 = time.perf_counter()
        try:
            test(*case)
            status = "ok"
        except Exception as e:  # noqa: BLE001 - report every case, then fail the run
            status = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            failures.append(f"{name}{case}")
        print(f"  {name} {case}: {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return failures


def check_parity(workdir: str, backends: list[str]) -> list[str]:
    """Greedy tokens of the engine against transformers, per attention backend."""
    import jax
    import numpy as np

    from jaxlm import LLM, SamplingParams
    from tests.engine.test_llm_engine_parity import MAX_TOKENS as max_tokens, _hf_greedy
    from tests.helpers.tiny_models import make_tiny_engine_model

    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 in the f32 reference run
    path = make_tiny_engine_model("llama", os.path.join(workdir, "tiny_llama"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, n).tolist() for n in (3, 9, 17, 33, 64, 5)]
    want = _hf_greedy(path, prompts)  # the parity test's reference: transformers' greedy generate
    failures = []
    for backend in backends:
        llm = LLM(model=path, dtype="float32", attention_backend=backend, max_num_seqs=8, max_model_len=256,
                  max_num_batched_tokens=128, token_buckets=[8, 32, 128], seq_buckets=[1, 8])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        same = sum(g == w for g, w in zip(got, want))
        compiles = llm.llm_engine.get_model_runner().num_compiles_after_warmup
        print(f"  {backend}: {same}/{len(prompts)} prompts token-for-token equal to transformers "
              f"({max_tokens} tokens each); compiles after warm-up: {compiles}", flush=True)
        for g, w, p in zip(got, want, prompts):
            if g != w:
                first = next(i for i, (a, b) in enumerate(zip(g + [None], w + [None])) if a != b)
                print(f"    prompt of {len(p)} tokens diverges at output token {first}", flush=True)
        if same != len(prompts) or compiles:
            failures.append(f"parity[{backend}]")
        llm.llm_engine.shutdown()
        del llm
    return failures


def make_smollm2_shaped(path: str, layers: int | None = None) -> str:
    """SmolLM2-135M's shape, random weights, bf16 safetensors, with the tests' byte tokenizer."""
    import torch
    import transformers

    from tests.helpers.tiny_tokenizer import write_byte_tokenizer

    cfg = dict(SMOLLM2)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return path


def decode_figures(path: str, batches: list[int], output_len: int, with_device: bool) -> None:
    """Decode tok/s per batch size (bf16), then host vs device ms per decode step."""
    import numpy as np

    from jaxlm import LLM, SamplingParams
    from jaxlm.benchmarks import host_overhead as bench_host

    # Few buckets: a 30-layer body compiles in seconds per program on a GPU (19 programs).
    llm = LLM(model=path, dtype="bfloat16", max_num_seqs=max(batches), max_model_len=512,
              max_num_batched_tokens=1024, token_buckets=sorted({1, max(batches), 1024}),
              seq_buckets=sorted({1, max(batches)}))
    runner = llm.llm_engine.get_model_runner()
    print(f"  {runner.num_programs} programs compiled in {runner.warmup_seconds:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for b in batches:
        prompts = [{"prompt_token_ids": rng.integers(3, 250, 128).tolist()} for _ in range(b)]
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm
        rates = []
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            first = min(o.metrics.first_token_ts for o in outs)
            last = max(o.metrics.last_token_ts for o in outs)
            rates.append(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first))
        print(f"  batch {b:>3}: decode {statistics.median(rates):,.0f} tok/s (128 in, {output_len} out, bf16)",
              flush=True)
    for b in batches:
        # As the decode figures above: final outputs only, no text (LLM.generate with detokenize=False).
        r = bench_host.measure_batch(llm, b, 16, min(output_len, 64), with_device=with_device,
                                     output_kind="FINAL_ONLY", detokenize=False)
        dev = f"; device alone {r['device_ms']:.2f} ms (body + sampler replayed back to back)" \
            if "device_ms" in r else ""
        parts = "  ".join(f"{p} {100 * s:.0f}%" for p, s in r["shares"].items())
        print(f"  batch {b:>3}: {r['ms_median']:.2f} ms per decode step{dev}\n             {parts}", flush=True)
    print(f"  compiles after warm-up: {runner.num_compiles_after_warmup}", flush=True)


def kernel_bandwidth(interpret: bool) -> int:
    args = [sys.executable, "-m", "jaxlm.bench", "kernels"]
    if interpret:
        args += ["--interpret", "--batch", "1", "--context", "64", "--iters", "1", "--num-heads", "4",
                 "--num-kv-heads", "1", "--head-dim", "64"]
    else:
        args += ["--batch", "1", "64", "--context", "512", "4096", "--iters", "20"]
    # This process holds JAX's GPU pre-allocation (75% of the card): the child takes what it uses
    # from the rest instead of trying to pre-allocate 75% too ("Failed to allocate" retries).
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return subprocess.run(args, cwd=_ROOT, env=env).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU, small, to test this script")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    a = p.parse_args()
    import jax

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not a.cpu_smoke:
        print(f"gpu_check: no GPU (jax backend {jax.default_backend()!r}); --cpu-smoke tests the script on CPU")
        return 2
    print(f"jax {jax.__version__}, devices: {[d.device_kind for d in jax.devices()]}", flush=True)
    workdir = a.workdir or tempfile.mkdtemp(prefix="jaxlm_gpu_check_")
    failures: list[str] = []
    t0 = time.perf_counter()
    steps = [
        ("1. Pallas kernels against their references" + (" (native)" if on_gpu else " (interpret, CPU smoke)"),
         lambda: failures.extend(check_kernels(interpret=not on_gpu))),
        ("2. greedy parity with transformers, both attention backends",
         lambda: failures.extend(check_parity(workdir, ["xla", "pallas"] if on_gpu else ["xla"]))),
        ("3. SmolLM2-shaped checkpoint (bf16, random weights): decode throughput, host vs device",
         lambda: decode_figures(make_smollm2_shaped(os.path.join(workdir, "smollm2"), None if on_gpu else 2),
                                [1, 64] if on_gpu else [1, 8], 128 if on_gpu else 16, with_device=True)),
        ("4. decode attention kernels: achieved HBM bandwidth (ours vs JAX's bundled Pallas kernel)",
         lambda: kernel_bandwidth(interpret=not on_gpu) == 0 or failures.append("bench_kernels")),
    ]
    for title, step in steps:
        section(f"{title}  [{time.perf_counter() - t0:.0f} s]")
        try:
            step()
        except Exception:  # noqa: BLE001 - a broken part must not hide the others
            traceback.print_exc()
            failures.append(title.split(".")[0])
    section(f"done in {time.perf_counter() - t0:.0f} s: " + ("all checks passed" if not failures
                                                               else "FAILED: " + ", ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
