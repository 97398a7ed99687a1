"""scripts/bench.py --prefill end to end on a tiny model: the table beside transformers, the
cached-suffix run (it really hits the cache), and the op-by-op profile's categories read from
the compiled program (attention, matmuls, norms, rope... each found)."""

import json
import os
import subprocess
import sys

from tests.helpers.tiny_models import make_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_prefill_bench(tmp_path):
    model = make_tiny_llama(tmp_path / "model")
    out = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--model", str(model), "--prefill",
           "--prefill-lens", "16,40", "--prefill-reps", "1", "--prefill-profile", "40", "--prefix-len", "40",
           "--suffix-len", "8", "--max-num-seqs", "1", "--max-num-batched-tokens", "64",  # fewer programs
           "--json", str(out), "--workdir", str(tmp_path / "work")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [row["tokens"] for row in res["prefill"]] == [16, 40]
    assert all(row["jaxlm_tok_s"] > 0 and row["hf_tok_s"] > 0 for row in res["prefill"])
    # 40-token prefix, blocks of 16: 32 tokens hit; the fresh run computes the same 16.
    assert res["suffix"]["cached_tokens"] == 32 and res["suffix"]["ratio"] > 0
    cats = {c for c, ms, _ in res["profile_40"] if ms > 0}
    assert {"attention", "matmuls", "norms", "rope", "KV writes"} <= cats, cats
    assert res["compiles_after_warmup"] == 0
    assert "suffix of 8 after a cached 40-token prefix" in r.stdout
    assert "max_num_batched_tokens=64, token buckets [1, 2, 4, 8, 16, 32, 64]" in r.stdout  # the flag reached the engine
