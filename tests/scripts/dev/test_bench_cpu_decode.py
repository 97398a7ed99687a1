"""scripts/dev/bench_cpu_decode.py runs the C++ kernel and prints its time per call."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_prints_time_per_call(cpu_kernels):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "dev", "bench_cpu_decode.py"), "--heads", "2,2,16",
           "--tokens", "8", "--context", "40", "--layers", "2", "--blocks", "64", "--reps", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"8 rows x 40 keys, heads 2,2,16: [0-9.]+ us per call", r.stdout), r.stdout
