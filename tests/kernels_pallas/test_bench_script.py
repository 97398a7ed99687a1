"""`jaxlm bench kernels` says clearly that it needs a GPU instead of timing interpret mode."""

import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU is present: the bench would run")
def test_bench_exits_without_gpu():
    r = subprocess.run([sys.executable, "-m", "jaxlm.bench", "kernels"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no GPU found" in r.stdout
