"""The compiled batch-1 decode step, op by op: where its time goes.

    python scripts/dev/profile_decode.py                  # the default model (SmolLM2 GGUF)
    python scripts/dev/profile_decode.py --model DIR      # any checkpoint

Decodes one request until the step is a steady batch-1 decode, then replays that step's two
programs (body: the model + KV writes; sampler: logits + sampling) under the JAX profiler. Each
executed XLA op (a thunk on CPU, a kernel on GPU) is timed by the profiler; its own time
(children excluded) is summed per op and classified by what the optimized HLO says the op is:
matmuls, the logits matmul, attention over pages, KV writes, norms, rope, the sampler, the
rest. Prints the table per program and per class, and the bytes each class reads (HLO cost
analysis) where XLA gives them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

CLASSES = ("matmul", "logits", "attention", "kv write", "norm", "rope", "sampler", "other")


def _computations(hlo: str) -> dict[str, str]:
    """name -> body text of each computation in an optimized HLO module."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name, lines = m.group(1), []
        elif line.startswith("}") and name:
            out[name] = "\n".join(lines)
            name = None
        elif name:
            lines.append(line)
    return out


def _instructions(hlo: str) -> dict[str, str]:
    """instruction name -> its line (every computation)."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            out[m.group(1)] = line
    return out


def classify(op: str, instrs: dict[str, str], comps: dict[str, str], in_loop: set[str], vocab: int,
             program: str) -> str:
    line = instrs.get(op, "")
    called = re.findall(r"calls=%?([\w.\-]+)", line)
    body = line + "\n" + "\n".join(comps.get(c, "") for c in called)
    is_dot = (" dot(" in body or "__onednn$matmul" in body or "xnn" in op or "ynn" in op or op.startswith("dot")
              or "jaxlm_gguf_matmul" in line)  # the C++ GGUF block product
    if program == "sampler":
        return "logits" if is_dot and str(vocab) in body else "sampler"
    if op in in_loop or "jaxlm_paged_decode" in body:  # the XLA loop, or the C++ kernel's custom call
        return "attention"
    if " scatter(" in body or "dynamic-update-slice(" in body:
        return "kv write"
    if is_dot:
        return "logits" if str(vocab) in line else "matmul"
    if " rsqrt(" in body:
        return "norm"
    if " sine(" in body or " cosine(" in body:
        return "rope"
    if " gather(" in body or " while(" in body:
        return "attention"
    return "other"


def _loop_ops(hlo: str, comps: dict[str, str]) -> set[str]:
    """Ops inside while-loop bodies (the XLA attention backend's loop over page chunks)."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    ops = set()
    for b in bodies:
        ops |= set(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", comps.get(b, ""), re.M))
    return ops


def self_times(trace_dir: str) -> dict[str, float]:
    """Op name -> summed own time (us) of the profiler's complete events, children excluded."""
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        tr = json.load(f)
    events = [e for e in (tr["traceEvents"] if isinstance(tr, dict) else tr) if e.get("ph") == "X"]
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    own = collections.Counter()
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []  # [event, child time]
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0].get("dur", 0) <= e["ts"]:
                done = stack.pop()
                own[done[0]["name"]] += done[0].get("dur", 0) - done[1]
            if stack:
                stack[-1][1] += e.get("dur", 0)
            stack.append([e, 0.0])
        for ev, child in stack:
            own[ev["name"]] += ev.get("dur", 0) - child
    return own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint (default: the engine's default model)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--top", type=int, default=12, help="ops listed per program")
    p.add_argument("--show-class", default=None, choices=CLASSES, help="list only this class's ops")
    p.add_argument("--hlo", action="store_true", help="print each listed op's HLO line")
    a = p.parse_args()
    import jax
    import numpy as np

    from jaxlm.benchmarks import host_overhead as bench_host
    from jaxlm import LLM, SamplingParams

    kw = {} if a.model is None else {"model": a.model}
    llm = LLM(**kw)
    runner = llm.llm_engine.get_model_runner()
    calls = bench_host._capture_programs(runner)
    vocab = runner.vocab_size
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(3, vocab - 3, 128).tolist()}
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    (body, body_args), (sample, sample_args) = calls["body"], calls["sample"]
    body_key = next(k for k, v in runner._body.items() if v.fn is body)
    sample_key = next(k for k, v in runner._sample.items() if v.fn is sample)
    print(f"batch-1 decode step: body{body_key}, sample{sample_key}; "
          f"jax {jax.__version__} on {jax.devices()[0].device_kind}")

    def step():
        outs = body(body_args[0], runner.kv_caches, *body_args[2:])
        runner.kv_caches = outs[-1]
        res = sample(sample_args[0], outs[0], *sample_args[2:])
        jax.block_until_ready(res)

    for _ in range(5):
        step()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(a.reps):
                step()
        own = self_times(d)
    total_by_class, count_by_class = collections.Counter(), collections.Counter()
    for program, exe in (("body", body), ("sampler", sample)):
        hlo = exe.as_text()
        comps, instrs = _computations(hlo), _instructions(hlo)
        loop = _loop_ops(hlo, comps)
        rows = [(name, us / a.reps) for name, us in own.items() if name in instrs]
        rows.sort(key=lambda r: -r[1])
        by_class = collections.Counter()
        for name, us in rows:
            c = classify(name, instrs, comps, loop, vocab, program)
            by_class[c] += us
            count_by_class[c] += 1
        total = sum(us for _, us in rows)
        total_by_class.update(by_class)
        print(f"\n{program}: {total:.0f} us per step in {len(rows)} ops; the largest:")
        shown = rows[:a.top] if not a.show_class else [r for r in rows if classify(
            r[0], instrs, comps, loop, vocab, program) == a.show_class][:a.top]
        for name, us in shown:
            print(f"  {us:8.1f} us  {100 * us / total:5.1f}%  {classify(name, instrs, comps, loop, vocab, program):<9} {name}")
            if a.hlo:
                print("      " + instrs.get(name, "")[:300])
    grand = sum(total_by_class.values())
    print(f"\nthe decode step by class ({grand:.0f} us of XLA ops per step, {a.reps} steps replayed):")
    print("| class | us per step | share | ops |\n|---|---|---|---|")
    for c in CLASSES:
        if total_by_class.get(c):
            print(f"| {c} | {total_by_class[c]:.0f} | {100 * total_by_class[c] / grand:.1f}% | {count_by_class[c]} |")
    t0 = time.perf_counter()
    for _ in range(a.reps):
        step()
    wall = (time.perf_counter() - t0) / a.reps * 1e6
    print(f"\nwall time per step without the profiler: {wall:.0f} us (ops' own time under it: {grand:.0f} us)")


if __name__ == "__main__":
    main()
