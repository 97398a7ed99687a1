"""Executor selection and the compilation cache set-up at engine start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.executor.abstract import Executor


def test_pipeline_stages_across_nodes_are_refused_by_name():
    config = EngineArgs(pipeline_parallel_size=2, nnodes=2).create_engine_config()
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2 with nnodes=2"):
        Executor.get_class(config)


@pytest.mark.parametrize("kwargs", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_tensor_or_pipeline_parallel_gets_the_mesh_executor(kwargs):
    from jaxlm.executor.mesh_executor import MeshExecutor

    assert Executor.get_class(EngineArgs(**kwargs).create_engine_config()) is MeshExecutor


def test_one_device_gets_the_uniproc_executor():
    from jaxlm.executor.uniproc_executor import UniProcExecutor

    assert Executor.get_class(EngineArgs().create_engine_config()) is UniProcExecutor


def test_configure_compilation_cache_once(tmp_path):
    # In a subprocess: the setting is process-wide JAX state.
    code = (
        "import jax\n"
        "from jaxlm.config import CompilationConfig\n"
        "from jaxlm.executor.compilation_cache import configure_compilation_cache as conf\n"
        f"first, second = {str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r}\n"
        "assert conf(CompilationConfig(compilation_cache_dir='')) is None\n"
        "assert not jax.config.jax_compilation_cache_dir\n"
        "assert conf(CompilationConfig(compilation_cache_dir=first)) == first\n"
        "assert jax.config.jax_compilation_cache_dir == first\n"
        "assert conf(CompilationConfig(compilation_cache_dir=second)) == first  # keeps the first\n"
        "assert jax.config.jax_compilation_cache_dir == first\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr


def test_worker_does_not_touch_jax_config():
    import inspect

    from jaxlm.worker import worker

    assert "jax.config" not in inspect.getsource(worker)


def test_master_addr_and_port_are_the_coordinator(monkeypatch):
    """--master-addr / --master-port (as the CLI parses them) are where jax.distributed meets."""
    import jax

    from jaxlm.executor import distributed
    from jaxlm.serve.cli_args import make_arg_parser

    seen = {}
    monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(distributed.jax.config, "update", lambda *a: None)  # process-wide: not here
    args = make_arg_parser().parse_args(["m", "--nnodes", "2", "--master-addr", "10.1.2.3", "--master-port", "4567"])
    distributed.init_distributed(EngineArgs.from_cli_args(args).create_engine_config().parallel_config)
    assert seen["coordinator_address"] == "10.1.2.3:4567"
    assert (seen["num_processes"], seen["process_id"]) == (2, 0)
    assert jax.process_count() == 1  # nothing was started
