"""Host overhead per decode step (`jaxlm bench host-overhead`, scripts/bench.py --host-overhead).

A tiny 2-layer Llama (float32, random weights, built with transformers) has near-zero device
time, so the wall time of its decode step is the engine's own overhead. For each batch size it
adds that many 16-token prompts, generates 200 greedy tokens each, and reports the milliseconds
per decode step (a step in which every running request decodes one token) and the share of
each part: schedule, prepare, transfer, dispatch, wait, output (the runner's bookkeeping after
the tokens are back), update (Scheduler.update_from_output), detokenize (the detokenizer and
the logprobs' token texts: text work only), outputs (the rest of the output processor: token
ids appended, RequestOutputs built), other (the rest of the engine step).

The requests are a streaming caller's by default (CUMULATIVE outputs with text every step);
--output-kind FINAL_ONLY --no-detokenize measures what LLM.generate(detokenize=False) does. Issue
38's "21% detokenize" at batch 64 on an H100 was CUMULATIVE text, measured beside decode figures
that asked for none; the row now says which requests it measured.

Runs against any checkout: where the runner has no StepTimer (code before issue 14) its step is
reported whole, as "execute".
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import numpy as np

PARTS = ("schedule", "prepare", "transfer", "dispatch", "wait", "output", "execute", "update",
         "detokenize", "outputs", "other")


def _timed(timer, part: str, fn, less: str | None = None):
    """fn, its time added to `part`; with `less`, minus the time `part`'s callees added to
    `less` meanwhile (nested parts are counted once)."""
    def wrapper(*args, **kwargs):
        inner = timer._pending.get(less, 0.0) if less else 0.0
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            inner = (timer._pending.get(less, 0.0) - inner) if less else 0.0
            timer.add(part, time.perf_counter() - t0 - inner)
    return wrapper


class StepTimer:
    """What ModelRunner.step_timer expects: `mark()` at the start of its step, `lap(part)` at
    each boundary (the time since the previous mark or lap goes to `part`). Engine-level parts
    are added with `add`; `commit` ends an engine step, keeping its parts or dropping them.
    With `trace` a list, every lap is also logged as (part, perf_counter)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._pending: dict[str, float] = {}
        self._last = time.perf_counter()
        self.trace: list[tuple[str, float]] | None = None

    def mark(self) -> None:
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self._pending[part] = self._pending.get(part, 0.0) + now - self._last
        self._last = now
        if self.trace is not None:
            self.trace.append((part, now))

    def add(self, part: str, seconds: float) -> None:
        self._pending[part] = self._pending.get(part, 0.0) + seconds
        if self.trace is not None:
            self.trace.append((part, time.perf_counter()))

    def commit(self, keep: bool) -> None:
        if keep:
            for part, s in self._pending.items():
                self.totals[part] = self.totals.get(part, 0.0) + s
        self._pending.clear()


def model_runner(engine) -> Any:
    """The engine's ModelRunner (older checkouts have no get_model_runner)."""
    if hasattr(engine, "get_model_runner"):
        return engine.get_model_runner()
    return engine.executor.worker.model_runner


def _instrument(engine) -> tuple[Any, list, Any]:
    """Wrap the engine's parts with timers; returns (timer, list receiving each step's
    scheduled-token counts as (total tokens, requests), a function that removes the wrappers)."""
    timer = StepTimer()
    runner = model_runner(engine)
    scheduled: list[tuple[int, int]] = []
    sched = engine.scheduler
    schedule = sched.schedule

    def timed_schedule(*a, **kw):
        t0 = time.perf_counter()
        so = schedule(*a, **kw)
        timer.add("schedule", time.perf_counter() - t0)
        scheduled.append((so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)))
        return so

    wrapped = [(sched, "schedule"), (sched, "update_from_output"), (engine.output_processor, "process_outputs")]
    sched.schedule = timed_schedule
    sched.update_from_output = _timed(timer, "update", sched.update_from_output)
    engine.output_processor.process_outputs = _timed(timer, "outputs", engine.output_processor.process_outputs,
                                                     less="detokenize")
    if hasattr(runner, "step_timer"):
        runner.step_timer = timer  # the runner laps its own parts
    else:
        engine.executor.execute_model = _timed(timer, "execute", engine.executor.execute_model)
        wrapped.append((engine.executor, "execute_model"))

    def remove() -> None:  # instance attributes shadow the methods: deleting them restores those
        for obj, name in wrapped:
            obj.__dict__.pop(name, None)
        if hasattr(runner, "step_timer"):
            runner.step_timer = None
    return timer, scheduled, remove


def _time_text_work(timer, states) -> None:
    """The detokenizer's and the logprobs' token-text calls of these requests go to "detokenize"."""
    for st in states:
        if getattr(st, "detokenizer", None) is not None:
            st.detokenizer.update = _timed(timer, "detokenize", st.detokenizer.update)
            st.detokenizer.get_next_output_text = _timed(timer, "detokenize", st.detokenizer.get_next_output_text)
        lp = getattr(st, "logprobs", None)
        if lp is not None and getattr(getattr(lp, "decode", None), "tokenizer", None) is not None:
            lp.decode = _timed(timer, "detokenize", lp.decode)


class _Capture:
    """Wraps a compiled program: remembers itself and the arguments of its latest call."""

    def __init__(self, fn, store: dict, what: str) -> None:
        self.fn, self.store, self.what = fn, store, what

    def __call__(self, *args):
        self.store[self.what] = (self.fn, args)
        return self.fn(*args)


def _capture_programs(runner) -> dict:
    calls: dict = {}
    for table, what in ((runner._body, "body"), (runner._sample, "sample")):
        for key, fn in list(table.items()):
            table[key] = _Capture(fn.fn if isinstance(fn, _Capture) else fn, calls, what)
    return calls


def device_ms(runner, calls: dict, reps: int = 30) -> float:
    """The last step's body and sampler programs replayed back to back with nothing between
    them (the KV cache argument is the runner's current one: it is donated): the step's own
    device time, median ms."""
    (body, body_args), (sample, sample_args) = calls["body"], calls["sample"]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = body(body_args[0], runner.kv_caches, *body_args[2:])
        runner.kv_caches = outs[-1]
        res = sample(sample_args[0], outs[0], *sample_args[2:])
        np.asarray(res[1] if isinstance(res, tuple) else res.sampled_token_ids)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure_batch(llm, batch: int, prompt_len: int, output_len: int, skip: int = 5,
                  with_device: bool = False, trace_steps: int = 0, output_kind: str = "CUMULATIVE",
                  detokenize: bool = True) -> dict:
    """ms per decode step at this batch size and the share of each part. output_kind: the
    RequestOutputKind's name (CUMULATIVE: a streaming caller's text every step; FINAL_ONLY:
    LLM.generate's one output at the end). "detokenize" is text work only (none with
    detokenize=False); "outputs" the rest of the output processor."""
    engine = llm.llm_engine
    timer, scheduled, remove = _instrument(engine)
    try:
        res = _measure(engine, timer, scheduled, batch, prompt_len, output_len, skip, with_device, trace_steps,
                       output_kind, detokenize)
    finally:
        remove()
    res.update(output_kind=output_kind, detokenize=detokenize)
    return res


def _measure(engine, timer, scheduled, batch: int, prompt_len: int, output_len: int, skip: int,
             with_device: bool, trace_steps: int, output_kind: str, detokenize: bool) -> dict:
    from jaxlm import SamplingParams
    from jaxlm.sampling_params import RequestOutputKind

    calls = _capture_programs(model_runner(engine)) if with_device else None
    vocab = engine.model_config.hf_config.vocab_size
    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind[output_kind], detokenize=detokenize)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": rng.integers(3, vocab - 3, prompt_len).tolist()},
                           params)
    _time_text_work(timer, getattr(engine.output_processor, "request_states", {}).values())
    step_times, cpu_times, seen = [], [], 0
    while engine.has_unfinished_requests():
        scheduled.clear()
        timer.trace = [] if skip < seen <= skip + trace_steps else None
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        # A decode step: one token for each of the `batch` requests (scheduled in this call).
        decode = bool(scheduled) and scheduled[0] == (batch, batch)
        seen += decode
        keep = decode and seen > skip
        if timer.trace:
            merged = [(p, t) for i, (p, t) in enumerate(timer.trace)
                      if i + 1 == len(timer.trace) or timer.trace[i + 1][0] != p]
            print(f"  engine step (decode {seen}), ms from its start to the end of each part: " + ", ".join(
                f"{part} {1e3 * (t - t0):.2f}" for part, t in merged)
                + ("  [async: prepare/transfer/dispatch are step N+1's, wait onwards step N's]"
                   if getattr(engine.engine_config.scheduler_config, "async_scheduling", False) else ""))
        if keep:
            step_times.append(wall)
            cpu_times.append(cpu)
            timer.add("other", wall - sum(timer._pending.values()))
        timer.commit(keep)
    total = sum(step_times)
    shares = {p: timer.totals.get(p, 0.0) / total for p in PARTS if timer.totals.get(p)}
    res = {"batch": batch, "steps": len(step_times), "ms_median": 1e3 * statistics.median(step_times),
           # The calling thread's CPU time: the host's own work, without XLA's threads or the
           # time this thread waited for a core (robust on a loaded machine; XLA:CPU may run a
           # small program inline on this thread, which then counts here).
           "cpu_ms_median": 1e3 * statistics.median(cpu_times),
           "ms_mean": 1e3 * total / len(step_times), "shares": shares}
    if calls is not None:  # the last step was a decode step of this batch (ignore_eos, same length)
        res["device_ms"] = device_ms(model_runner(engine), calls)
    return res


def throughput(llm, num: int = 64, input_len: int = 128, output_len: int = 128) -> float:
    """Output tokens/s of `num` requests of input_len random tokens, output_len greedy tokens each."""
    from jaxlm import SamplingParams

    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab - 3, input_len).tolist()} for _ in range(num)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
                        use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def make_engine(model_dir: str | None, async_scheduling: bool | None, max_num_seqs: int):
    from jaxlm import LLM

    kw: dict[str, Any] = {} if model_dir is None else {"model": model_dir}  # None: the engine's default
    if async_scheduling is not None:
        kw["async_scheduling"] = async_scheduling
    return LLM(dtype="float32", max_num_seqs=max_num_seqs, max_model_len=256, max_num_batched_tokens=1024,
               token_buckets=[1, 8, 64, 1024], seq_buckets=[1, 8, 64], num_gpu_blocks_override=1024, **kw)


def tiny_llama(workdir: str, hidden: int | None = None, layers: int | None = None) -> str:
    """The tests' tiny Llama (2 layers, hidden 64), or wider/deeper to give the device work."""
    from tests.helpers.tiny_models import make_tiny_engine_model

    kw = {} if hidden is None else dict(hidden_size=hidden, intermediate_size=4 * hidden)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    return make_tiny_engine_model("llama", workdir, **kw)


def bench_host_overhead(batches=(1, 8, 64), prompt_len: int = 16, output_len: int = 200,
                        async_modes=(None,), model: str | None = "tiny", rounds: int = 1,
                        with_device: bool = False, trace_steps: int = 0,
                        with_throughput: bool = False, tiny_size: tuple = (None, None),
                        output_kind: str = "CUMULATIVE", detokenize: bool = True) -> list[dict]:
    """Engines for every mode side by side in this process; rounds alternate the modes (the
    machine's speed drifts: compare figures of one run). model: "tiny" (the 2-layer Llama),
    None (the engine's default model) or a path."""
    import logging

    logging.getLogger("jaxlm").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_llama(tmp, *tiny_size) if model == "tiny" else model
        engines = {mode: make_engine(model_dir, mode, 64) for mode in async_modes}
        results = []
        for _ in range(rounds):
            for b in batches:
                for mode, llm in engines.items():
                    r = measure_batch(llm, b, prompt_len, output_len, with_device=with_device,
                                      trace_steps=trace_steps, output_kind=output_kind, detokenize=detokenize)
                    r["async_scheduling"] = mode
                    results.append(r)
                    print_row(r)
            if with_throughput:
                for mode, llm in engines.items():
                    label = {None: "default", True: "async", False: "sync"}[mode]
                    print(f"[{label}] 64 x (128 in, 128 out): {throughput(llm):.1f} output tok/s", flush=True)
        for mode, llm in engines.items():
            print(f"  compiles after warm-up ({mode}): {llm.llm_engine.get_model_runner().num_compiles_after_warmup}")
    return results


def print_row(r: dict) -> None:
    mode = {None: "default", True: "async", False: "sync"}[r["async_scheduling"]]
    parts = "  ".join(f"{p} {100 * s:.0f}%" for p, s in r["shares"].items())
    kind = f"{r.get('output_kind', 'CUMULATIVE')}{'' if r.get('detokenize', True) else ', no text'}"
    print(f"[{mode}] batch {r['batch']:>3} ({kind}): {r['ms_median']:.2f} ms/decode step (median; mean "
          f"{r['ms_mean']:.2f}, {r['steps']} steps)  {parts}", flush=True)
    if "device_ms" in r:
        print(f"    device alone (body + sampler back to back): {r['device_ms']:.2f} ms; step / device = "
              f"{r['ms_median'] / r['device_ms']:.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """`jaxlm bench host-overhead` (with --vs DIR: this checkout against another, jaxlm/benchmarks/host_ab.py)."""
    import argparse
    import os
    import sys

    if argv and any(a == "--vs" or a.startswith("--vs=") for a in argv):
        from jaxlm.benchmarks import host_ab

        host_ab.main(argv)
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.helpers
    p = argparse.ArgumentParser(prog="jaxlm bench host-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="--vs DIR [--batches ...] [--rounds N]: this checkout against another, "
                                       "interleaved (jaxlm/benchmarks/host_ab.py)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--async-modes", nargs="+", default=["default"], choices=["default", "on", "off"])
    p.add_argument("--model", default="tiny", help="tiny (default), 'default' (the engine's) or a path")
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--device-time", action="store_true", help="also replay the step's programs alone")
    p.add_argument("--trace", type=int, default=0,
                   help="print the timeline of this many decode steps (async: step N+1's prepare, transfer "
                        "and dispatch end before step N's wait)")
    p.add_argument("--throughput", action="store_true", help="also 64 x (128 in, 128 out) output tok/s per round")
    p.add_argument("--tiny-size", type=int, nargs=2, default=(None, None), metavar=("HIDDEN", "LAYERS"),
                   help="a larger tiny model, e.g. 1024 8: device time per step near the host's")
    p.add_argument("--output-kind", default="CUMULATIVE", choices=["CUMULATIVE", "DELTA", "FINAL_ONLY"],
                   help="the requests' RequestOutputKind (LLM.generate: FINAL_ONLY)")
    p.add_argument("--no-detokenize", action="store_true", help="requests with detokenize=False (no text)")
    a = p.parse_args(argv)
    bench_host_overhead(tuple(a.batches), output_len=a.output_len,
                        async_modes=tuple({"default": None, "on": True, "off": False}[m] for m in a.async_modes),
                        model=None if a.model == "default" else a.model, rounds=a.rounds,
                        with_device=a.device_time, trace_steps=a.trace, with_throughput=a.throughput,
                        tiny_size=tuple(a.tiny_size), output_kind=a.output_kind, detokenize=not a.no_detokenize)


if __name__ == "__main__":
    main()
