"""Prefill: tok/s by prompt length beside transformers on the same checkpoint, the cost of a
suffix after a cached prefix beside the same suffix fresh, and the prefill program op by op.

    python scripts/bench.py --prefill                                # default model (SmolLM2)
    python scripts/bench.py --prefill --prefill-lens 500,1500 --prefill-profile 500

One process: the engine (LLM, its default flags, prefix caching on: every timed prompt is
new random tokens, so only the suffix run hits the cache) and transformers' model (float32,
one forward with ``logits_to_keep=1``), timed in turn on the same prompts; medians of
``--prefill-reps``. A GGUF (the default model) is dequantized to safetensors first, and both
run those weights. torch's OpenMP threads spin while they wait unless OMP_WAIT_POLICY says
otherwise; on a shared machine that spinning starves both sides, so this sets it to PASSIVE
when unset (printed). Wall and CPU seconds are both printed: on a loaded machine CPU seconds
say more about the work done, wall seconds about what a user sees.
"""

from __future__ import annotations

import gzip
import glob
import json
import os
import re
import statistics
import tempfile
import time
from typing import Callable

import numpy as np



def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def _median(xs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)


def _checkpoint(model: str | None, workdir: str) -> str:
    """A safetensors directory both engines read: the model, or the GGUF dequantized."""
    from jaxlm.benchmarks import bucket_engine as bench_engine

    from jaxlm.model_loader.formats import default_model_path

    path = model or default_model_path()
    return bench_engine.gguf_as_safetensors(path, workdir) if path.endswith(".gguf") else path


def _prompts(seed: int, vocab: int) -> Callable[[int], list[int]]:
    """n -> n random token ids (never seen before: no prefix-cache hits between them)."""
    rng = np.random.default_rng(seed)
    low = min(100, vocab // 4)
    return lambda n: rng.integers(low, min(vocab, 30000), n).tolist()


def prefill_vs_hf(llm, hf, lens: list[int], reps: int, draw: Callable[[int], list[int]]) -> list[dict]:
    import torch

    from jaxlm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1)
    rows = []
    for n in lens:
        ours, theirs = [], []
        for _ in range(reps):
            ids = draw(n)
            ours.append(_timed(lambda: llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)))
            with torch.no_grad():
                theirs.append(_timed(lambda: hf(torch.tensor([ids]), logits_to_keep=1)))
        (jw, jc), (hw, hc) = _median(ours), _median(theirs)
        rows.append(dict(tokens=n, jaxlm_tok_s=n / jw, hf_tok_s=n / hw, ratio=hw / jw,
                         jaxlm_cpu_s=jc, hf_cpu_s=hc, cpu_ratio=hc / jc))
        r = rows[-1]
        print(f"{n:>8} {r['hf_tok_s']:>16.0f} {r['jaxlm_tok_s']:>12.0f} {r['ratio']:>10.2f}x "
              f"{hc:>10.2f} {jc:>10.2f} {r['cpu_ratio']:>8.2f}x", flush=True)
    return rows


def suffix_vs_fresh(llm, prefix: int, suffix: int, reps: int, draw: Callable[[int], list[int]]) -> dict:
    """A ``suffix``-token prompt after a cached ``prefix`` (whole blocks hit) against the same
    number of new tokens as a fresh prompt, interleaved."""
    from jaxlm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1)
    gen = lambda ids: llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]  # noqa: E731
    hit, fresh, cached = [], [], []
    for _ in range(reps):
        head = draw(prefix)
        gen(head)  # fills the prefix cache
        tail = draw(suffix)
        out = []
        hit.append(_timed(lambda: out.append(gen(head + tail))))
        cached.append(out[0].num_cached_tokens)
        new = prefix + suffix - cached[-1]  # what the hit run computed
        fresh.append(_timed(lambda: gen(draw(new))))
    (hw, hc), (fw, fc) = _median(hit), _median(fresh)
    res = dict(prefix=prefix, suffix=suffix, cached_tokens=statistics.median(cached),
               hit_s=hw, fresh_s=fw, ratio=hw / fw, hit_cpu_s=hc, fresh_cpu_s=fc)
    print(f"suffix of {suffix} after a cached {prefix}-token prefix ({res['cached_tokens']:.0f} tokens "
          f"hit): {1e3 * hw:.0f} ms (cpu {1e3 * hc:.0f}) vs the same new tokens fresh {1e3 * fw:.0f} ms "
          f"(cpu {1e3 * fc:.0f}): {res['ratio']:.2f}x", flush=True)
    return res


# What an op of the prefill program is: the first frame of its stack (innermost out) that one
# of these (file part, function part) pairs matches.
_CATEGORIES = [
    ("KV writes", ("/attention/", "write_kv")),
    ("KV writes", ("/attention/", "scatter_kv")),  # kv_quant's scatter, innermost under write_kv
    ("attention", ("/attention/", "")),
    ("attention", ("/kernels_pallas/", "")),
    ("rope", ("/rotary.py", "")),
    ("norms", ("", "RMSNorm.")),
    ("norms", ("", "LayerNorm.")),
    ("logits", ("", "compute_logits")),
    ("logits", ("", "LMHead.")),
    ("logits", ("", "Embedding.attend")),
    ("matmuls", ("", "Linear.")),
    ("embedding", ("", "Embedding.")),
]
_OTHER = "other (residual adds, copies, input unpacking)"


def _hlo_index(text: str) -> tuple[str, dict[str, str]]:
    """(module name, {instruction: category}) from a compiled program's HLO text."""
    module = re.match(r"HloModule (\S+?),", text).group(1)
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
        elif current is not None and line and line[0].isdigit():
            key, _, rest = line.partition(" ")
            current[int(key)] = rest
        elif not line.strip():
            current = None
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    locs = {}
    for k, v in sections.get("FileLocations", {}).items():
        f, fn = (int(re.search(rf"{key}=(\d+)", v).group(1)) for key in ("file_name_id", "function_name_id"))
        locs[k] = (files.get(f, ""), funcs.get(fn, ""))
    frames = {}
    for k, v in sections.get("StackFrames", {}).items():
        loc, parent = (int(x) for x in re.findall(r"=(\d+)", v)[:2])
        frames[k] = (loc, parent - 1)  # printed one past the parent's id; 0 = none

    def category(frame: int) -> str:
        seen = set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            file, func = locs.get(frames[frame][0], ("", ""))
            for cat, (in_file, in_func) in _CATEGORIES:
                if in_file in file and in_func in func:
                    return cat
            frame = frames[frame][1]
        return _OTHER

    ops = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", text, re.M):
        name, rest = m.groups()
        if re.search(r"\bwhile\(|\bconditional\(|\bcall\(", rest):
            ops[name] = None  # a container: its body's ops have their own events
            continue
        sf = re.search(r"stack_frame_id=(\d+)", rest)
        ops[name] = category(int(sf.group(1))) if sf else _OTHER
    return module, ops


def profile_prefill(llm, n: int, draw: Callable[[int], list[int]]) -> list[tuple[str, float, float]]:
    """An ``n``-token prompt's steps op by op (XLA:CPU thunk events from the JAX profiler),
    summed per category: [(category, ms, share)]. Every chunk must land in one token bucket
    (the body programs of all buckets share a module name)."""
    import jax

    from jaxlm import SamplingParams
    from jaxlm.worker.buckets import pick_bucket

    runner = llm.llm_engine.get_model_runner()
    budget = runner.config.scheduler_config.max_num_batched_tokens
    chunks = [budget] * (n // budget) + ([n % budget] if n % budget else [])
    buckets = {pick_bucket(c, runner.token_buckets) for c in chunks}
    if len(buckets) != 1:
        raise ValueError(f"--prefill-profile {n}: its chunks {chunks} fall in several token buckets {buckets}")
    T = buckets.pop()
    module, ops = _hlo_index(runner._body[(T, "mixed")].as_text())
    sp = SamplingParams(temperature=0, max_tokens=1)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            llm.generate([{"prompt_token_ids": draw(n)}], sp, use_tqdm=False)
        path = glob.glob(os.path.join(d, "**", "*.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    totals: dict[str, float] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        if args.get("hlo_module") == module:
            cat = ops.get(args["hlo_op"], _OTHER)
        else:
            cat = "logits + sampler (the sample program)"
        if cat is not None:
            totals[cat] = totals.get(cat, 0.0) + e["dur"] / 1e3
    whole = sum(totals.values()) or 1.0
    rows = sorted(((c, ms, ms / whole) for c, ms in totals.items()), key=lambda r: -r[1])
    print(f"prefill of {n} tokens ({len(chunks)} step(s) of bucket {T}), op by op (thunk ms, all threads):")
    for c, ms, share in rows:
        print(f"  {c:<48} {ms:>9.1f} ms {100 * share:>6.1f}%")
    return rows


def bench_prefill(model: str | None, lens: list[int], reps: int, profile: list[int],
                  prefix: int, suffix: int, workdir: str, json_path: str | None = None,
                  max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import transformers

    from jaxlm import LLM

    ckpt = _checkpoint(model, workdir)
    threads = os.cpu_count() or 2
    torch.set_num_threads(threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        hf(torch.tensor([list(range(100, 164))]), logits_to_keep=1)  # first-call set-up
    kw = {k: v for k, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)) if v}
    llm = LLM(model=ckpt, enable_prefix_caching=True, **kw)
    runner = llm.llm_engine.get_model_runner()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?") if os.path.exists("/proc/cpuinfo") else "?"
    sched = runner.config.scheduler_config
    print(f"checkpoint {ckpt}; {cpu}, {threads} threads; torch OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; "
          f"jaxlm max_num_batched_tokens={sched.max_num_batched_tokens}, token buckets {runner.token_buckets}",
          flush=True)
    draw = _prompts(0, int(hf.config.vocab_size))
    print(f"{'tokens':>8} {'transformers t/s':>16} {'jaxlm t/s':>12} {'ratio':>11} {'hf cpu s':>10} "
          f"{'jaxlm cpu s':>10} {'cpu ratio':>9}", flush=True)
    res = {"prefill": prefill_vs_hf(llm, hf, lens, reps, draw),
           "suffix": suffix_vs_fresh(llm, prefix, suffix, reps, draw)}
    for n in profile:
        res[f"profile_{n}"] = profile_prefill(llm, n, draw)
    res["load_average"] = os.getloadavg()
    res["compiles_after_warmup"] = runner.num_compiles_after_warmup
    print(f"load average {res['load_average'][0]:.1f}; compiles after warm-up {res['compiles_after_warmup']}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    return res
