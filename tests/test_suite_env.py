"""Collecting the suite imports every test module (and the cases modules some import): none may
give the suite's process, or the servers it starts, 8 host devices. With them, a server's
program cache is off and the tests waiting for it hang (CI on 2bfb55c)."""

from __future__ import annotations

import os

import pytest

from tests.helpers.suite_env import XLA_FLAGS_AT_START


def test_collection_left_xla_flags_alone(request: pytest.FixtureRequest) -> None:
    assert os.environ.get("XLA_FLAGS", "") == request.config.stash[XLA_FLAGS_AT_START]


def test_importing_a_cases_module_keeps_one_device(tmp_path) -> None:
    import subprocess
    import sys
    code = ("import os, tests.helpers.pp_cases, tests.helpers.load_peak; import jax; "
            "print(os.environ.get('XLA_FLAGS', ''), jax.local_device_count())")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1"], out.stdout
