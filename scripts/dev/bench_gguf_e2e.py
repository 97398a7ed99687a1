"""A GGUF file served three ways, side by side in one run: jaxlm with the weights in their GGUF
blocks (``--quantization gguf``, the default for .gguf), jaxlm dequantized to float32
(``--quantization none``) and llama.cpp (llama-cpp-python, same file, same threads).

    python scripts/dev/bench_gguf_e2e.py [--model FILE.gguf] [--rounds 3] [--threads 2]
        [--variants gguf none llama.cpp] [--batch16] [--prefill 512]

A variant may name another checkout, ``gguf@DIR`` (its jaxlm and kernels first on the path), to
time a change against a baseline in the same rounds.

One child process per variant loads the model once; every round asks each child in turn (the
order rotating between rounds) for one measurement, so the machine's drift hits all alike:
  * decode tok/s, batch 1: a 128-token prompt, then 128 greedy tokens; the decode time is the
    time of 129 generated tokens minus that of 1 (the prefill and first token), so the prompt's
    cost is left out alike for both engines (prefix caching off, llama.cpp's cache reset);
  * --batch16: 16 such prompts at once (jaxlm only: llama-cpp-python's Llama decodes one
    sequence), generated tokens per second of the decode;
  * --prefill N: seconds for an N-token prompt and one token.
Medians over rounds; the resident memory (RSS) of the child and its engine process after warm-up too. jaxlm's programs are warmed before
the first round (compiles are not measured).

llama.cpp's threads wait at barriers by spinning, so any other process on a 2-core machine (even at
nice 15) drops its decode 10x: run the whole script under ``chrt -f 10`` (every child inherits
it) on a shared machine. On a CPU with AMX-INT8, llama-cpp-python 0.3.36's AMX matmul segfaults:
the script then turns off llama.cpp's extra buffer types (AMX and repacking), or build it without
AMX (``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX_VNNI=ON ..." pip install llama-cpp-python==0.3.36``), which
keeps repacking (measured the same speed here, docs/PERF_NOTES.md, session 12).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_TAG = "@@gguf "
PROMPT, NEW = 128, 128


def _prompt(n: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(100, 40000) for _ in range(n)]


class _Jaxlm:
    def __init__(self, model: str, quantization: str, batch16: bool) -> None:
        from jaxlm import LLM, SamplingParams

        self.sp = SamplingParams
        # Only the buckets measured below (fewer programs to compile): batch-1 decode runs at
        # token bucket 1, so the kernels see one row as in a server; prompts are one 512 step.
        wide = [16] if batch16 else []
        self.llm = LLM(model=model, quantization=quantization, enable_prefix_caching=False, max_model_len=1024,
                       max_num_seqs=16 if batch16 else 1, max_num_batched_tokens=512,
                       token_buckets=[1, *wide, 512], seq_buckets=[1, *wide])

    def run(self, prompts: list[list[int]], new: int) -> float:
        sp = self.sp(max_tokens=new, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t0


def llama_cpp_without_amx() -> None:
    """llama.cpp 0.3.36's AMX matmul (its extra buffer type, chosen where the CPU has AMX-INT8)
    crashes with SIGSEGV on this file's first decode; without the extra buffer types (AMX and
    weight repacking) it runs. Called before a Llama is made; says so when it applies."""
    import llama_cpp
    import llama_cpp.llama as ll

    if b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        return
    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    ll.llama_cpp.llama_model_default_params = params
    print("llama.cpp: AMX-INT8 CPU: extra buffer types off (its AMX matmul segfaults in 0.3.36)",
          file=sys.stderr, flush=True)


class _LlamaCpp:
    def __init__(self, model: str, threads: int) -> None:
        from llama_cpp import Llama

        llama_cpp_without_amx()
        self.llm = Llama(model_path=model, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         verbose=False)

    def run(self, prompts: list[list[int]], new: int) -> float:
        assert len(prompts) == 1
        self.llm.reset()
        t0 = time.perf_counter()
        n = 0
        for _ in self.llm.generate(prompts[0], temp=0.0, reset=True):
            n += 1
            if n >= new:
                break
        return time.perf_counter() - t0


def _child(variant: str, model: str, threads: int, batch16: bool) -> None:
    import logging

    logging.getLogger("jaxlm").setLevel(logging.WARNING)
    eng = _LlamaCpp(model, threads) if variant == "llama.cpp" else _Jaxlm(model, variant, batch16)
    # Warm-up: every shape measured below once.
    for n in (PROMPT, 512):
        eng.run([_prompt(n, 0)], 2)
    if batch16 and variant != "llama.cpp":
        eng.run([_prompt(PROMPT, i) for i in range(16)], 4)
    print(_TAG + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out: dict = {}
        p1 = [_prompt(PROMPT, req["round"])]
        out["decode_tok_s"] = NEW / (eng.run(p1, NEW + 1) - eng.run(p1, 1))
        if req.get("batch16") and variant != "llama.cpp":
            ps = [_prompt(PROMPT, 100 * req["round"] + i) for i in range(16)]
            out["batch16_tok_s"] = 16 * NEW / (eng.run(ps, NEW + 1) - eng.run(ps, 1))
        if req.get("prefill"):
            out["prefill_s"] = eng.run([_prompt(req["prefill"], 7 + req["round"])], 1)
        out["rss_mb"] = _rss_mb()
        print(_TAG + json.dumps(out), flush=True)


def _rss_mb() -> float:
    """Resident memory of this process and its children (jaxlm's engine core may be one)."""
    import psutil

    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 1e6


def _read(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:
        if line.startswith(_TAG):
            return json.loads(line[len(_TAG):])
    raise RuntimeError(f"child exited ({proc.wait()})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the default model's)")
    p.add_argument("--variants", nargs="+", default=["gguf", "none", "llama.cpp"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch16", action="store_true")
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model is None:
        from jaxlm.model_loader.formats import default_model_path

        args.model = default_model_path()
    if args.child:
        return _child(args.child, args.model, args.threads, args.batch16)
    procs = {}
    for v in args.variants:  # one at a time: loads and compiles do not overlap
        variant, _, tree = v.partition("@")
        env = dict(os.environ)
        if tree:  # another checkout's jaxlm (and kernels) first on the path
            env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), env.get("PYTHONPATH", "")])
        procs[v] = subprocess.Popen([sys.executable, __file__, "--child", variant, "--model", args.model,
                                     "--threads", str(args.threads), *(["--batch16"] if args.batch16 else [])],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        _read(procs[v])
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
        for v in order:
            procs[v].stdin.write(json.dumps({"round": r, "batch16": args.batch16, "prefill": args.prefill}) + "\n")
            procs[v].stdin.flush()
            results[v].append(_read(procs[v]))
            print(v, r, results[v][-1], flush=True)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    print(f"\nmodel {args.model} ({os.path.getsize(args.model) / 1e6:.1f} MB), {args.rounds} rounds, medians; "
          f"load {os.getloadavg()}")
    for v in args.variants:
        keys = results[v][0].keys()
        print(v, {k: round(statistics.median(x[k] for x in results[v]), 3) for k in keys})


if __name__ == "__main__":
    main()
