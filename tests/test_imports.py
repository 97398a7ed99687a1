"""The front end is light: `import jaxlm` and `python -m jaxlm.serve --help` load no jax or flax,
and the executor interface does not import its implementations (no import cycle)."""

from __future__ import annotations

import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HEAVY = ("jax", "flax", "transformers", "torch")
_CHECK = (
    "heavy = sorted({m.split('.')[0] for m in sys.modules} & set(%r)); "
    "assert not heavy, 'imported ' + ', '.join(heavy)" % (_HEAVY,)
)


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_import_jaxlm_is_light():
    _run("import sys, jaxlm; jaxlm.SamplingParams(max_tokens=2); jaxlm.EngineArgs(max_model_len=64)"
         ".create_engine_config(); print(jaxlm.__version__); " + _CHECK)


def test_serve_help_is_light():
    out = _run(
        "import runpy, sys\n"
        "sys.argv = ['jaxlm.serve', '--help']\n"
        "try:\n    runpy.run_module('jaxlm.serve', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n" + _CHECK)
    assert "--max-model-len" in out.stdout and "--kv-cache-memory-bytes" in out.stdout


def test_console_script_help_is_light():
    out = _run(
        "import sys\nfrom jaxlm.cli import main\n"
        "try:\n    main(['serve', '--help'])\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n" + _CHECK)
    assert out.stdout.startswith("usage: jaxlm serve")


def test_bench_help_is_light():
    """`jaxlm bench --help` and each subcommand's --help (engine flags included) load no jax."""
    out = _run(
        "import sys\nfrom jaxlm.cli import main\n"
        "for argv in (['bench', '--help'], ['bench', 'throughput', '--help'], ['bench', 'latency', '--help'],\n"
        "             ['bench', 'serve', '--help']):\n"
        "    try:\n        main(argv)\n"
        "    except SystemExit as e:\n        assert e.code == 0, e.code\n" + _CHECK)
    assert "usage: jaxlm bench throughput" in out.stdout and "--max-num-batched-tokens" in out.stdout
    assert "--max-concurrency" in out.stdout and "--num-iters-warmup" in out.stdout


def test_executor_interface_does_not_import_its_implementations():
    _run("import sys, jaxlm.executor.abstract; "
         "assert 'jaxlm.executor.uniproc_executor' not in sys.modules")


def test_version_is_pyproject_version():
    import tomllib
    from importlib import metadata

    import jaxlm

    with open(os.path.join(_REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert jaxlm.__version__ == metadata.version("jaxlm") == project["version"]
    # the console script points at a real function
    module, _, name = project["scripts"]["jaxlm"].partition(":")
    assert callable(getattr(__import__(module, fromlist=[name]), name))
