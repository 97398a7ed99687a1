"""jaxlm's GPU paths, checked and measured in one run (scripts/gpu_check.sh calls this).

Each part runs in a process of its own, under a time box and a budget for the whole run
(--budget, default 450 s: the run fits 8 minutes on one H100 with the wheels' install): a part
that overruns is killed and reported, the rest go on; the parts run in order of value and one
that no longer fits the budget is skipped. Output streams as it comes; the last line is ONE JSON
object of every figure and every part's status. This process never touches the GPU (it does not
import jax), so each part has the whole card: JAX's pre-allocation of 75% in one process no longer
starves the next (the "Failed to allocate device memory" of `jaxlm bench kernels`, issue 38),
and a part that starts a GPU process of its own (the server) does not pre-allocate itself.

  devices         jax, the devices
  kernels         each Pallas kernel natively against its pure-JAX reference
  parity          greedy LLM.generate, attention backends xla and pallas, against transformers
  decode          SmolLM2-shaped bf16: decode tok/s at batch 1 and 64, host ms per step by part
                  beside the step's device ms (LLM.generate's requests: final outputs, no text)
  kernel_bw       the Pallas decode kernel's HBM bandwidth beside JAX's bundled kernel
  nano_vllm       nano-vllm's workload on a Qwen3-0.6B shape, beside published figures
  cg_*, kv_fp8, w_fp8   ITL at batch 1 and 8: command-buffer modes, fp8 KV cache, fp8 weights
  serve           the server under `jaxlm bench serve` at concurrency 1, 16, 64
  prefill         prefill tok/s at 512, 2,048, 8,192 tokens
  hf              transformers' generate at batch 1 and 64 (a same-run ratio with `decode`)

Exit status 0 when every part passed, 1 when one failed or was cut, 2 without a GPU (unless
--cpu-smoke: every part on CPU, tiny shapes, kernels in interpret mode; figures mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "kernels_pallas")]


class Figures:
    """A part's figures, rewritten to its JSON file at each put (a part killed keeps them)."""

    def __init__(self, path: str) -> None:
        self.path, self.data = path, {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f)
        os.replace(self.path + ".tmp", self.path)


def devices(fig: Figures, workdir: str, smoke: bool) -> None:
    import jax

    fig.put("jax", jax.__version__)
    fig.put("backend", jax.default_backend())
    fig.put("devices", [d.device_kind for d in jax.devices()])
    print(f"  jax {jax.__version__}, devices: {fig.data['devices']}", flush=True)


def kernels(fig: Figures, workdir: str, smoke: bool) -> None:
    """The kernel tests' cases, natively (interpret mode on CPU)."""
    import test_kernels as tk

    def forced(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kwargs["interpret"] = smoke
            return fn(*args, **kwargs)
        return call

    tk.paged_decode_attention = forced(tk.paged_decode_attention)
    tk.ragged_paged_attention = forced(tk.ragged_paged_attention)
    cases = [("paged_decode", tk.test_decode_matches_reference, c) for c in tk.DECODE_CASES]
    cases += [("ragged_paged", tk.test_ragged_matches_reference, c) for c in tk.RAGGED_CASES]
    failed = []
    for name, test, case in cases[:2] if smoke else cases:
        t0 = time.perf_counter()
        try:
            test(*case)
            status = "ok"
        except Exception as e:  # noqa: BLE001 - report every case, then fail the part
            status = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            failed.append(f"{name}{case}")
        print(f"  {name} {case}: {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    fig.put("cases", len(cases[:2] if smoke else cases))
    fig.put("failed", failed)
    assert not failed, f"{len(failed)} kernel cases failed"


def parity(fig: Figures, workdir: str, smoke: bool) -> None:
    """Greedy tokens of the engine against transformers', per attention backend."""
    import jax
    import numpy as np

    from jaxlm import LLM, SamplingParams
    from tests.engine.test_llm_engine_parity import MAX_TOKENS as max_tokens, _hf_greedy
    from tests.helpers.tiny_models import make_tiny_engine_model

    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 in the f32 reference run
    path = make_tiny_engine_model("llama", os.path.join(workdir, "tiny_llama"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, n).tolist() for n in (3, 9, 17, 33, 64, 5)]
    want = _hf_greedy(path, prompts)
    for backend in ["xla"] if smoke else ["xla", "pallas"]:
        llm = LLM(model=path, dtype="float32", attention_backend=backend, max_num_seqs=8, max_model_len=256,
                  max_num_batched_tokens=128, token_buckets=[8, 32, 128], seq_buckets=[1, 8])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        same = sum(o.outputs[0].token_ids == w for o, w in zip(outs, want))
        compiles = llm.llm_engine.get_model_runner().num_compiles_after_warmup
        fig.put(backend, {"equal": same, "prompts": len(prompts), "compiles_after_warmup": compiles})
        print(f"  {backend}: {same}/{len(prompts)} prompts token-for-token equal to transformers "
              f"({max_tokens} tokens each); compiles after warm-up: {compiles}", flush=True)
        llm.llm_engine.shutdown()
        assert same == len(prompts) and not compiles, f"parity[{backend}]"


def decode(fig: Figures, workdir: str, smoke: bool) -> None:
    """SmolLM2-shaped bf16: decode and end-to-end tok/s per batch, host vs device ms per step."""
    import numpy as np

    from jaxlm import LLM, SamplingParams
    from jaxlm.benchmarks import gpu_anchors as ga
    from jaxlm.benchmarks import host_overhead as bench_host

    batches, output_len = ([1, 8], 16) if smoke else ([1, 64], 128)
    llm = LLM(model=ga.smollm2(workdir, smoke), **(ga.SMOL_ENGINE_SMOKE if smoke else ga.SMOL_ENGINE))
    runner = llm.llm_engine.get_model_runner()
    fig.put("programs", runner.num_programs)
    fig.put("warmup_s", round(runner.warmup_seconds, 1))
    print(f"  {runner.num_programs} programs ready in {runner.warmup_seconds:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for b in batches:
        prompts = [{"prompt_token_ids": rng.integers(3, 250, 128).tolist()} for _ in range(b)]
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm
        rates, e2e = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            e2e.append(b * output_len / (time.perf_counter() - t0))
            span = max(o.metrics.last_token_ts for o in outs) - min(o.metrics.first_token_ts for o in outs)
            rates.append(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / span)
        fig.put(f"decode_tok_s_b{b}", round(statistics.median(rates), 1))
        fig.put(f"e2e_tok_s_b{b}", round(statistics.median(e2e), 1))
        print(f"  batch {b:>3}: decode {statistics.median(rates):,.0f} tok/s, whole generate "
              f"{statistics.median(e2e):,.0f} tok/s (128 in, {output_len} out, bf16)", flush=True)
    for b in batches:
        # As the decode figures above: final outputs only, no text (LLM.generate with detokenize=False).
        r = bench_host.measure_batch(llm, b, 16, min(output_len, 64), with_device=True,
                                     output_kind="FINAL_ONLY", detokenize=False)
        fig.put(f"host_b{b}", {"ms_per_step": round(r["ms_median"], 3), "device_ms": round(r["device_ms"], 3),
                               "shares": {p: round(s, 3) for p, s in r["shares"].items()}})
        parts = "  ".join(f"{p} {100 * s:.0f}%" for p, s in r["shares"].items())
        print(f"  batch {b:>3}: {r['ms_median']:.2f} ms per decode step; device alone {r['device_ms']:.2f} ms "
              f"(body + sampler replayed back to back)\n             {parts}", flush=True)
    fig.put("compiles_after_warmup", runner.num_compiles_after_warmup)
    llm.llm_engine.shutdown()


def kernel_bw(fig: Figures, workdir: str, smoke: bool) -> None:
    from jaxlm.benchmarks import kernels as bench_kernels

    out = os.path.join(workdir, "kernels.json")
    args = ["--json", out]
    if smoke:
        args += ["--interpret", "--batch", "1", "--context", "64", "--iters", "1", "--num-heads", "4",
                 "--num-kv-heads", "1", "--head-dim", "64"]
    else:
        args += ["--batch", "1", "64", "--context", "512", "4096", "--iters", "20"]
    assert bench_kernels.main(args) == 0, "jaxlm bench kernels failed"
    with open(out) as f:
        rows = json.load(f)["rows"]
    fig.put("rows_us", [{k: (round(1e6 * v, 1) if isinstance(v, float) and k not in ("mb", "err") else v)
                         for k, v in r.items()} for r in rows])


def _anchor(name: str, *args: Any) -> Callable[[Figures, str, bool], None]:
    def run(fig: Figures, workdir: str, smoke: bool) -> None:
        from jaxlm.benchmarks import gpu_anchors

        getattr(gpu_anchors, name)(*args, fig, workdir, smoke)
    return run


# name -> (function, time box in seconds on one H100, in order of value). The boxes are guesses
# until a GPU run measures them; --part-timeout NAME=S overrides one.
PARTS: dict[str, tuple[Callable[[Figures, str, bool], None], float]] = {
    "devices": (devices, 60), "kernels": (kernels, 60), "parity": (parity, 75), "decode": (decode, 110),
    "kernel_bw": (kernel_bw, 60), "nano_vllm": (_anchor("nano_vllm"), 150),
    "cg_default": (_anchor("decode_variant", "default"), 60),
    "cg_none": (_anchor("decode_variant", "cg_none"), 60),
    "cg_full_decode": (_anchor("decode_variant", "cg_full_decode"), 60),
    "serve": (_anchor("serve_load"), 100), "prefill": (_anchor("prefill"), 70), "hf": (_anchor("hf_generate"), 60),
    "kv_fp8": (_anchor("decode_variant", "kv_fp8"), 60), "w_fp8": (_anchor("decode_variant", "w_fp8"), 60),
}
# Parts that start a GPU process of their own, or use torch: no JAX pre-allocation in them.
NO_PREALLOCATE = ("serve", "hf")


def part_env(name: str, smoke: bool) -> dict[str, str]:
    """The environment a part's process gets."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
    if name in NO_PREALLOCATE:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def run_part(name: str, box: float, workdir: str, smoke: bool) -> dict[str, Any]:
    """One part in its own process group, killed at `box` seconds; its status and figures."""
    path = os.path.join(workdir, f"figures_{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--workdir", workdir] + ["--cpu-smoke"] * smoke
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=part_env(name, smoke), start_new_session=True)
    try:
        rc = proc.wait(timeout=box)
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue
        status = f"cut at its time box ({box:.0f} s)"
    figures = {}
    if os.path.exists(path):
        with open(path) as f:
            figures = json.load(f)
    return {**figures, "status": status, "seconds": round(time.perf_counter() - t0, 1)}


def child(name: str, workdir: str, smoke: bool) -> int:
    fig = Figures(os.path.join(workdir, f"figures_{name}.json"))
    try:
        PARTS[name][0](fig, workdir, smoke)
        return 0
    except Exception:  # noqa: BLE001 - the parent reports it and goes on
        traceback.print_exc()
        return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU, small, to test this script")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all parts together")
    p.add_argument("--only", nargs="+", choices=list(PARTS), default=None, help="these parts only (devices first)")
    p.add_argument("--part-timeout", nargs="+", default=[], metavar="NAME=S", help="override a part's time box")
    p.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # a part's own process
    a = p.parse_args(argv)
    workdir = a.workdir or tempfile.mkdtemp(prefix="jaxlm_gpu_check_")
    os.makedirs(workdir, exist_ok=True)
    if a.part:
        return child(a.part, workdir, a.cpu_smoke)
    # On CPU (smoke) the boxes are XLA:CPU's compile times, not the GPU's: only --part-timeout cuts.
    boxes = {name: 1800.0 if a.cpu_smoke else box for name, (_, box) in PARTS.items()}
    for item in a.part_timeout:
        name, _, seconds = item.partition("=")
        if name not in boxes:
            p.error(f"--part-timeout {item}: no part {name!r} (parts: {', '.join(PARTS)})")
        boxes[name] = float(seconds)
    names = ["devices"] + [n for n in PARTS if n != "devices" and (a.only is None or n in a.only)]
    deadline, t0, report = time.perf_counter() + a.budget, time.perf_counter(), {}
    for name in names:
        left = deadline - time.perf_counter()
        box = boxes[name] if a.cpu_smoke else min(boxes[name], left)
        print(f"\n== {name}  [{time.perf_counter() - t0:.0f} s; box {box:.0f} s]", flush=True)
        if box < 20 and not a.cpu_smoke:
            report[name] = {"status": f"skipped: {left:.0f} s of the budget left"}
            print(f"  {report[name]['status']}", flush=True)
            continue
        report[name] = run_part(name, box, workdir, a.cpu_smoke)
        print(f"  -> {report[name]['status']} in {report[name]['seconds']} s", flush=True)
        if name == "devices" and report[name].get("backend") != "gpu" and not a.cpu_smoke:
            print("gpu_check: no GPU (see above); --cpu-smoke tests the script on CPU", flush=True)
            return 2
    _ratios(report)
    bad = [n for n, r in report.items() if r["status"] != "ok"]
    print(f"\n== done in {time.perf_counter() - t0:.0f} s: " + ("every part passed" if not bad
                                                              else "not ok: " + ", ".join(bad)), flush=True)
    print(json.dumps({"gpu_check": report, "cpu_smoke": a.cpu_smoke, "seconds": round(time.perf_counter() - t0, 1)}),
          flush=True)
    return 1 if bad else 0


def _ratios(report: dict[str, dict]) -> None:
    """Same-run ratios: jaxlm's whole-generate tok/s over transformers' at each batch."""
    ours, hf = report.get("decode", {}), report.get("hf", {})
    for key in [k for k in hf if k.startswith("e2e_tok_s_b")]:
        if key in ours and hf[key]:
            hf.setdefault("jaxlm_over_transformers", {})[key[len("e2e_tok_s_"):]] = round(ours[key] / hf[key], 1)


if __name__ == "__main__":
    sys.exit(main())
