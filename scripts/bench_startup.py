"""Server start-up: seconds from the command to the first 200 on /health, cold and warm.

    python scripts/bench_startup.py                      # default model: 1 cold + 3 warm starts
    python scripts/bench_startup.py --warm 5 --timeline  # also each log line's second

Cold: a fresh cache directory (no compiled programs, no converted tokenizer or weights). Warm:
the same directory again, as a restarted server finds it. Each start's log lines are stamped
with the seconds since the command, so --timeline shows where the time goes (imports, model
config, tokenizer, the engine-core process, weights, programs). The load average is printed
beside each figure: the machine is shared.
"""

from __future__ import annotations

import argparse
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


def start_once(args: list[str], cache_dir: str, timeout: float, timeline: bool) -> float:
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
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cold", type=int, default=1, help="cold starts (each with a fresh cache directory)")
    p.add_argument("--warm", type=int, default=3, help="warm starts after the first cold one")
    p.add_argument("--timeline", action="store_true", help="print each start's log lines with their second")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--cache-dir", default=None, help="keep the cache here (default: a temp dir, removed)")
    p.add_argument("serve_args", nargs="*", help="arguments for python -m jaxlm.serve (after --)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="jaxlm_startup_")
    try:
        cache = a.cache_dir or os.path.join(root, "cache")
        for i in range(a.cold):
            shutil.rmtree(cache, ignore_errors=True)
            before = _load()
            s = start_once(a.serve_args, cache, a.timeout, a.timeline)
            print(f"cold start {i}: {s:.1f} s to a 200 on /health (load average {before} -> {_load()})", flush=True)
        warm = []
        for i in range(a.warm):
            before = _load()
            warm.append(start_once(a.serve_args, cache, a.timeout, a.timeline))
            print(f"warm start {i}: {warm[-1]:.1f} s (load average {before} -> {_load()})", flush=True)
        if warm:
            print(f"warm median: {sorted(warm)[len(warm) // 2]:.1f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
