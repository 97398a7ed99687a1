"""scripts/gpu_check.py: each part in a process of its own under a time box, one JSON line at the end.

The whole --cpu-smoke run (every part, small) takes minutes on 2 CPU cores; this runs the parent
with two cheap parts: one that passes and one cut by its box. The parts themselves are run by
hand (`scripts/gpu_check.sh --cpu-smoke`) and on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402


def test_a_part_over_its_box_is_cut_the_rest_report_and_the_parent_never_imports_jax(tmp_path):
    code = ("import sys; sys.path.insert(0, 'scripts'); import gpu_check; "
            f"rc = gpu_check.main(['--cpu-smoke', '--only', 'hf', '--part-timeout', 'hf=1', '--workdir', {str(tmp_path)!r}]); "
            "print('JAX_IN_PARENT', 'jax' in sys.modules); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 1, out.stdout + out.stderr
    assert lines[-1] == "JAX_IN_PARENT False"  # the parent holds no device memory a part needs
    report = json.loads(lines[-2])["gpu_check"]  # the one JSON line, last of the run's own output
    assert report["devices"]["status"] == "ok" and report["devices"]["backend"] == "cpu"
    assert report["hf"]["status"] == "cut at its time box (1 s)" and report["hf"]["seconds"] < 30


def test_parts_that_start_gpu_processes_of_their_own_do_not_preallocate(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    # The server part's process only drives the server, whose engine core takes the card; torch
    # (transformers' part) has its own allocator: neither may hold JAX's 75% beside them.
    for name in ("serve", "hf"):
        assert gpu_check.part_env(name, smoke=False)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    # The others are the one GPU user of their moment (the parent has none): the whole card.
    for name in ("kernel_bw", "decode", "nano_vllm"):
        assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in gpu_check.part_env(name, smoke=False)
    assert gpu_check.part_env("decode", smoke=True)["JAX_PLATFORMS"] == "cpu"
