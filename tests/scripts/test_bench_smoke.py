"""scripts/bench.py end to end on a tiny model: two bucket configs, the JSON it writes, and `auto`
beating `pow2` on a workload whose steps cluster between two powers of two."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.tiny_models import make_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_PROGRAMS = 12


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    model = make_tiny_llama(tmp / "model")
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
        assert c["output_tok_s"] > 0 and c["num_output_tokens"] > 0
        for key in ("ttft_s", "tpot_s"):
            assert 0 < c[key]["p50"] <= c[key]["p99"]
        assert c["peak_rss_mb"] > 0
        assert c["token_buckets"][-1] >= 64 and c["seq_buckets"][-1] >= 2


def test_auto_respects_the_budget_and_pads_less_than_pow2(bench_json):
    pow2, auto = bench_json["configs"]
    assert auto["programs"] <= MAX_PROGRAMS < pow2["programs"]
    assert auto["padding_waste"]["tokens"] < pow2["padding_waste"]["tokens"]
    # The simulation reproduces the engine's steps: the padding it planned is what was computed.
    assert auto["padding_waste"]["tokens"] == pytest.approx(auto["planned_waste"]["tokens"], abs=1e-9)
