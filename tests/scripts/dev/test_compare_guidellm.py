"""scripts/dev/compare_guidellm.py puts guidellm's per-request records on vLLM's definitions."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _load():
    spec = importlib.util.spec_from_file_location("compare_guidellm",
                                                  os.path.join(ROOT, "scripts", "dev", "compare_guidellm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_guidellm_round_uses_vllm_tpot_and_midpoint_median(tmp_path):
    # Two requests of 11 tokens: latency 2.0 s / TTFT 1.0 s and 3.0 s / TTFT 0.5 s.
    reqs = [{"time_to_first_token_ms": t, "request_latency": lat, "output_tokens": 11, "prompt_tokens": 256}
            for t, lat in ((1000.0, 2.0), (500.0, 3.0))]
    bench = {"metrics": {"output_tokens_per_second": {"successful": {"mean": 4.4}},
                         "time_to_first_token_ms": {"successful": {"median": 500.0}},
                         "time_per_output_token_ms": {"successful": {"median": 181.8}}},
             "requests": {"successful": reqs}, "duration": 5.0, "warmup_duration": 0.0, "cooldown_duration": 0.0}
    path = tmp_path / "gl.json"
    path.write_text(json.dumps({"benchmarks": [bench]}))
    g = _load().guidellm_round(str(path))
    # vLLM's TPOT excludes the first token: (2000 - 1000) / 10 = 100 and (3000 - 500) / 10 = 250.
    assert g["tpot"] == pytest.approx(175.0)
    assert g["ttft"] == pytest.approx(750.0)  # numpy's midpoint, not guidellm's lower median (500)
    assert (g["n"], g["out"], g["in"], g["tok_s"]) == (2, 22, 512, 4.4)
