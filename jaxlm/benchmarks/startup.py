"""Server start-up: seconds from the command to the first 200 on /health, cold and warm.

    jaxlm bench startup                      # default model: 1 cold + 3 warm starts
    jaxlm bench startup --warm 5 --timeline  # also each log line's second
    jaxlm bench startup --cold 0 --warm 3 --first-request --alt="--no-defer-program-load"

Cold: a fresh cache directory (no compiled programs, no converted tokenizer or weights). Warm:
the same directory again, as a restarted server finds it. --first-request also sends one
completion right after the 200 and times its answer, and waits for the log line saying a
deferred warm start has loaded its last program, or a cold start compiled its last one in the
background (a cold start always waits for that line: the program cache is written then, and the
warm starts need it). --alt ARGS: each start (cold and warm) is run a second
time with these extra arguments, interleaved (A, B, A, B, ...); after cold starts, each variant's
warm starts use its own directory. Each start's log lines are stamped
with the seconds since the command, so --timeline shows where the time goes (imports, model
config, tokenizer, the engine-core process, weights, programs). The load average is printed
beside each figure: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _first_request(port: int, t0: float) -> float:
    """Seconds from the command to the answer of one short greedy completion."""
    base = f"http://127.0.0.1:{port}/v1"
    with urllib.request.urlopen(base + "/models", timeout=600) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base + "/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)["choices"][0]["text"]  # noqa: B018 - a real answer, or a KeyError
    return time.perf_counter() - t0


# The log lines saying every program is in place: a deferred warm start's, a background compile's.
ALL_PROGRAMS = ("all deferred programs loaded", "programs compiled (")


def _wait_line(lines: list[str], needles: tuple[str, ...], timeout: float) -> float | None:
    """The second (since the command) of the first log line holding a needle, waiting up to timeout."""
    end = time.perf_counter() + timeout
    while True:
        hit = next((line for line in list(lines) if any(n in line for n in needles)), None)
        if hit is not None:
            return float(hit.split("s", 1)[0])
        if time.perf_counter() > end:
            return None
        time.sleep(0.1)


def start_once(args: list[str], cache_dir: str, timeout: float, timeline: bool,
               first_request: bool = False, cold: bool = False) -> dict:
    port = _free_port()
    env = {**os.environ, "JAXLM_CACHE_DIR": cache_dir}
    cmd = [sys.executable, "-m", "jaxlm.serve", *args, "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(f"{time.perf_counter() - t0:7.2f}s  {line.rstrip()[:160]}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + "\n".join(lines[-20:]))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        elapsed = time.perf_counter() - t0
                        break
            except OSError:
                pass
            time.sleep(0.05)
        else:
            raise TimeoutError(f"no 200 on /health within {timeout} s")
        result = {"health": elapsed}
        if first_request:
            result["first_answer"] = _first_request(port, t0)
        # Only a start that said it would finish later: a background compile, a deferred load.
        if any("compile in the background" in line or "loaded on use" in line for line in list(lines)):
            if first_request or cold:
                result["all_programs"] = _wait_line(lines, ALL_PROGRAMS, timeout)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
        if timeline:
            print("\n".join(line for line in lines if "%|" not in line or "100%" in line))
    return result


def _show(r: dict) -> str:
    extra = "".join(f", {k.replace('_', ' ')} at {v:.1f} s" for k, v in r.items() if k != "health" and v is not None)
    return f"{r['health']:.1f} s{extra}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="jaxlm bench startup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cold", type=int, default=1, help="cold starts (each with a fresh cache directory)")
    p.add_argument("--warm", type=int, default=3, help="warm starts after the first cold one")
    p.add_argument("--timeline", action="store_true", help="print each start's log lines with their second")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--cache-dir", default=None, help="keep the cache here (default: a temp dir, removed)")
    p.add_argument("--first-request", action="store_true",
                   help="after the 200, time one completion's answer and the last deferred program's load "
                        "or background compile")
    p.add_argument("--alt", default=None, help="extra serve arguments for an interleaved second run of each warm start")
    p.add_argument("serve_args", nargs="*", help="arguments for python -m jaxlm.serve (after --)")
    a = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="jaxlm_startup_")
    try:
        cache = a.cache_dir or os.path.join(root, "cache")
        variants = {"": a.serve_args} | ({a.alt: a.serve_args + a.alt.split()} if a.alt else {})
        # After cold starts each variant warms from its own directory: one shared directory would
        # hold only the last cold start's entries (each cold start empties it first).
        caches = {name: cache if a.cold == 0 or not name else cache + "-alt" for name in variants}
        for i in range(a.cold):
            for name, args in variants.items():
                shutil.rmtree(caches[name], ignore_errors=True)
                before = _load()
                s = start_once(args, caches[name], a.timeout, a.timeline, a.first_request, cold=True)
                print(f"cold start {i}{' ' + name if name else ''}: {_show(s)} to a 200 on /health "
                      f"(load average {before} -> {_load()})", flush=True)
        warm: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(a.warm):
            for name, args in variants.items():
                before = _load()
                r = start_once(args, caches[name], a.timeout, a.timeline, a.first_request)
                warm[name].append(r["health"])
                print(f"warm start {i}{' ' + name if name else ''}: {_show(r)} "
                      f"(load average {before} -> {_load()})", flush=True)
        for name, times in warm.items():
            if times:
                print(f"warm median{' ' + name if name else ''}: {sorted(times)[len(times) // 2]:.1f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
