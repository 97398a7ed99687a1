"""scripts/bench.py end to end on a tiny model: two bucket configs, the JSON it writes, and `auto`
beating `pow2` on a workload whose steps cluster between two powers of two; on a model whose
context is shorter than the workload, the default workload is fitted and a file is refused, each
in one line before anything compiles."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.tiny_models import make_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_PROGRAMS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny llama: 256 positions, shorter than the default synthetic workload's requests."""
    return make_tiny_llama(tmp_path_factory.mktemp("bench-model") / "model")


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "out.json"
    # Budget 64, 2 sequences: each prompt of 40-44 tokens is scheduled with one decode row, so
    # steps of 41-45 tokens, which pow2 pads to 64. The shared compile cache keeps reruns quick;
    # --no-cold: one engine process per config (the cold + cached pair is the same code twice).
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--model", str(model),
           "--workload", "synthetic:num=6,prompt=40-44,output=2-12", "--max-num-seqs", "2",
           "--max-num-batched-tokens", "64", "--buckets", "pow2", "auto", "--max-programs", str(MAX_PROGRAMS),
           "--compile-cache", "default", "--no-cold", "--json", str(out), "--workdir", str(tmp / "work")]
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "auto = --token-buckets" in r.stdout  # the derived config, as flags to pass on
    return json.loads(out.read_text())


def test_json_fields(bench_json):
    assert bench_json["num_requests"] == 6
    names = [c["name"] for c in bench_json["configs"]]
    assert names == ["pow2", "auto"]
    for c in bench_json["configs"]:
        assert c["programs"] > 0 and c["compiles_after_warmup"] == 0
        assert c["warmup_cold_s"] > 0 and "warmup_cached_s" not in c
        assert set(c["padding_waste"]) == {"tokens", "rows", "pages", "samples"}
        assert all(0 <= v < 1 for v in c["padding_waste"].values())
        # vLLM's serving keys, from the same code as `jaxlm bench` (jaxlm/benchmarks/metrics.py).
        assert c["completed"] == 6 and c["failed"] == 0 and c["total_output_tokens"] > 0
        assert c["output_throughput"] == pytest.approx(c["total_output_tokens"] / c["duration"])
        for name in ("ttft", "tpot", "e2el"):
            assert 0 < c[f"median_{name}_ms"] <= c[f"p99_{name}_ms"]
        assert c["peak_rss_mb"] > 0
        assert c["token_buckets"][-1] >= 64 and c["seq_buckets"][-1] >= 2


def test_auto_respects_the_budget_and_pads_less_than_pow2(bench_json):
    pow2, auto = bench_json["configs"]
    assert auto["programs"] <= MAX_PROGRAMS < pow2["programs"]
    assert auto["padding_waste"]["tokens"] < pow2["padding_waste"]["tokens"]
    # The simulation reproduces the engine's steps: the padding it planned is what was computed.
    assert auto["padding_waste"]["tokens"] == pytest.approx(auto["planned_waste"]["tokens"], abs=1e-9)


@pytest.fixture
def bench():
    """scripts/bench.py as a module."""
    spec = importlib.util.spec_from_file_location("bench_script", os.path.join(ROOT, "scripts", "bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_info(model: str):
    """(vocab, tokenizer, positions) of the tiny model, as bench.py's _model_info reads them
    (which also pins jax to the CPU: not in this process)."""
    from transformers import AutoConfig, AutoTokenizer

    return 320, AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model).max_position_embeddings


def test_default_workload_is_fitted_to_a_short_context(bench, model, capsys):
    args = bench.parse_args(["--model", model, "--num-requests", "32"])
    vocab, tok, model_len = _model_info(model)
    assert model_len == 256
    wl = bench._workload(args, vocab, tok, model_len)
    assert len(wl.requests) == 32 and wl.max_total_len() <= 256
    assert bench._engine_kwargs(args, wl)["max_model_len"] <= 256  # what the engine processes get
    [line] = capsys.readouterr().out.splitlines()
    assert "the model holds 256" in line and line.endswith("instead")


def test_a_workload_file_too_long_is_refused_in_one_line(bench, model, tmp_path):
    workload = tmp_path / "long.jsonl"
    workload.write_text(json.dumps({"prompt_token_ids": [5] * 40, "output_len": 8}) + "\n"
                        + json.dumps({"prompt_token_ids": [5] * 300, "output_len": 8}) + "\n")
    common = ["--model", model, "--workload", str(workload), "--workdir", str(tmp_path / "work")]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), *common], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr[-3000:])
    assert r.stderr.splitlines()[-1] == ("bench.py: workload long.jsonl: 1 of 2 requests need more than the "
                                         "model's 256 tokens (up to 308); pass --max-model-len 256 to drop them")
    assert "Traceback" not in r.stderr and "Compiling" not in r.stderr  # refused before any engine started
    vocab, tok, model_len = _model_info(model)
    with pytest.raises(ValueError, match="--max-model-len 512 is more than the model's 256 positions"):
        bench._workload(bench.parse_args([*common, "--max-model-len", "512"]), vocab, tok, model_len)
    args = bench.parse_args([*common, "--max-model-len", "256"])  # asked: the long request is dropped
    assert len(bench._workload(args, vocab, tok, model_len).requests) == 1
