"""Run a cases module in a subprocess with 8 CPU devices (the module asks XLA for them before
importing jax; the rest of the suite keeps one device) and read back the JSON it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cases(module: str, work: Path, timeout: int = 840) -> dict:
    """``python -m MODULE OUT.json WORK`` from the repository root; its results. The suite's
    XLA_FLAGS (tests/conftest.py) go along, but for a device count: the module sets its own."""
    out = work / "results.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    proc = subprocess.run([sys.executable, "-m", module, str(out), str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())
