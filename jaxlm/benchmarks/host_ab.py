"""Host overhead per decode step, this checkout against another one, interleaved in one run.

    jaxlm bench host-overhead --vs /tmp/base875 --batches 1 64 --rounds 3

Two child processes, one per checkout (jaxlm imported from that tree; the measuring code is
jaxlm/benchmarks/host_overhead.py from this one, which runs against any checkout), each build the same
tiny model's engine once; then every round asks each child in turn (the order alternating
between rounds) for one measurement per batch size. The machine's speed drifts, so the ratio
is taken round by round and its median printed beside the medians of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
_TAG = "@@ab "


def _child_main(model_dir: str, async_mode: str) -> None:
    """In a child: build the engine, then answer one JSON request per stdin line."""
    import logging

    bench_host = _load_sibling("host_overhead")

    logging.getLogger("jaxlm").setLevel(logging.WARNING)
    mode = {"default": None, "on": True, "off": False}[async_mode]
    llm = bench_host.make_engine(model_dir, mode, 64)
    print(_TAG + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        r = bench_host.measure_batch(llm, req["batch"], 16, req["output_len"], output_kind=req["output_kind"],
                                     with_device=req.get("device_time", False))
        r["compiles"] = bench_host.model_runner(llm.llm_engine).num_compiles_after_warmup
        print(_TAG + json.dumps(r), flush=True)


def _load_sibling(name: str):
    """This checkout's measuring module by its path, so the child's jaxlm is its own tree's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_ab_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Child:
    def __init__(self, tree: str, model_dir: str, async_mode: str) -> None:
        boot = (f"import importlib.util, sys; sys.path.insert(0, {tree!r}); "
                f"spec = importlib.util.spec_from_file_location('_ab', {os.path.abspath(__file__)!r}); "
                f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
                f"m._child_main({model_dir!r}, {async_mode!r})")
        env = {**os.environ, "PYTHONPATH": tree}
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=tree)
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(_TAG):
                return json.loads(line[len(_TAG):])
        raise RuntimeError(f"the child for {self.tree} exited ({self.proc.wait()})")

    def measure(self, batch: int, output_len: int, output_kind: str, device_time: bool = False) -> dict:
        req = {"batch": batch, "output_len": output_len, "output_kind": output_kind, "device_time": device_time}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _parts(r: dict) -> str:
    return " ".join(f"{p} {100 * s:.0f}%" for p, s in r["shares"].items())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="jaxlm bench host-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vs", required=True, help="the other checkout (e.g. a `git worktree add` of the baseline)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--output-kind", default="CUMULATIVE", choices=["CUMULATIVE", "DELTA", "FINAL_ONLY"],
                   help="the requests' RequestOutputKind: CUMULATIVE (a streaming caller's text each step, "
                        "SamplingParams' default) or FINAL_ONLY (LLM.generate's)")
    p.add_argument("--async-mode", default="default", choices=["default", "on", "off"],
                   help="this checkout's async scheduling (the other runs its default)")
    p.add_argument("--device-time", action="store_true",
                   help="also replay each side's last decode step's programs alone (its device time)")
    a = p.parse_args(argv)
    sys.path.insert(0, _HERE)
    from tests.helpers.tiny_models import make_tiny_engine_model

    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"CPU: {cpu} x {os.cpu_count()}; requests' output kind: {a.output_kind}", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_engine_model("llama", tmp)
        here, there = _Child(_HERE, model_dir, a.async_mode), _Child(os.path.abspath(a.vs), model_dir, "default")
        ratios: dict[int, list[float]] = {b: [] for b in a.batches}
        ms: dict[tuple[str, int], list[float]] = {}
        cpu: dict[tuple[str, int], list[float]] = {}
        cpu_ratios: dict[int, list[float]] = {b: [] for b in a.batches}
        for rnd in range(a.rounds):
            for b in a.batches:
                pair = [("this", here), ("other", there)]
                order = pair if rnd % 2 == 0 else pair[::-1]
                res = {name: child.measure(b, a.output_len, a.output_kind, a.device_time) for name, child in order}
                for name, r in res.items():
                    ms.setdefault((name, b), []).append(r["ms_median"])
                    dev = f", device {r['device_ms']:.3f} ms" if "device_ms" in r else ""
                    print(f"round {rnd} batch {b:>3} {name:>5}: {r['ms_median']:.3f} ms/step{dev}  {_parts(r)}"
                          f"  (compiles after warm-up: {r['compiles']})", flush=True)
                ratios[b].append(res["other"]["ms_median"] / res["this"]["ms_median"])
                cpu_ratios[b].append(res["other"]["cpu_ms_median"] / res["this"]["cpu_ms_median"])
                for name, r in res.items():
                    cpu.setdefault((name, b), []).append(r["cpu_ms_median"])
        here.close()
        there.close()
    with open("/proc/loadavg") as f:
        print(f"load average at end: {' '.join(f.read().split()[:3])}")
    for b in a.batches:
        print(f"batch {b:>3}: this {statistics.median(ms[('this', b)]):.3f} ms/step, other "
              f"{statistics.median(ms[('other', b)]):.3f} ms/step, other/this per round "
              f"{', '.join(f'{r:.2f}' for r in ratios[b])} (median {statistics.median(ratios[b]):.2f}x)")
        print(f"batch {b:>3}, calling thread's CPU ms/step: this {statistics.median(cpu[('this', b)]):.3f}, other "
              f"{statistics.median(cpu[('other', b)]):.3f}, other/this per round "
              f"{', '.join(f'{r:.2f}' for r in cpu_ratios[b])} (median {statistics.median(cpu_ratios[b]):.2f}x)")


if __name__ == "__main__":
    main()
