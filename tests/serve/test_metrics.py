"""/metrics on the shared `python -m jaxlm.serve`: prometheus_client's parser reads it with the
types vLLM's dashboards expect, every metric is there, and each moves when requests run."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import SERVED_MODEL

pytestmark = pytest.mark.timeout(600)

COUNTERS = ["vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits", "vllm:num_preemptions"]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info", "vllm:model_weight_bytes"]
# Histograms observed once per finished sequence or token (all move with any request).
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
              "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
              "vllm:request_time_per_output_token_seconds",
              "vllm:iteration_tokens_total"]


def _families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(server.metrics_text())}


def _sample(families: dict, family: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in families[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_types_presence_and_movement(real_server):
    r = httpx.get(real_server.base + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    before = _families(real_server)
    for name in COUNTERS:
        assert before[name].type == "counter", name
    for name in GAUGES:
        assert before[name].type == "gauge", name
    for name in HISTOGRAMS:
        assert before[name].type == "histogram", name
    for s in before["vllm:time_to_first_token_seconds"].samples:
        assert s.labels.get("model_name") == SERVED_MODEL
    [info] = before["vllm:cache_config_info"].samples
    assert info.value == 1.0 and info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0
    assert "process_resident_memory_bytes" in before and "process_cpu_seconds" in before
    # The engine core's loaded weights (a float model here), handed over in its ready message.
    [weights] = before["vllm:model_weight_bytes"].samples
    assert weights.labels["quantization"] == "none" and weights.value > 10_000

    client = real_server.client()
    cmpl = client.completions.create(model=SERVED_MODEL, prompt="The capital of France is Paris. " * 6,
                                     max_tokens=5, n=2, temperature=0.0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   extra_body={"ignore_eos": True})
    after = _families(real_server)

    for name in HISTOGRAMS:
        grew = _sample(after, name, name + "_count") - _sample(before, name, name + "_count")
        assert grew > 0, name
    # One observation per sequence (n=2 counts twice), one per request for the max.
    seqs = _sample(after, "vllm:request_params_n", "vllm:request_params_n_count") - _sample(
        before, "vllm:request_params_n", "vllm:request_params_n_count")
    assert seqs == 3
    assert _sample(after, "vllm:request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens_sum") \
        - _sample(before, "vllm:request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens_sum") == 8
    assert _sample(after, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") \
        - _sample(before, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 13
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries"):
        assert _sample(after, name, name + "_total") > _sample(before, name, name + "_total"), name
    assert _sample(after, "vllm:request_success", "vllm:request_success_total", finished_reason="length") \
        - _sample(before, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
    # Every engine step is counted: the prompt of each sequence that got its first token in it
    # plus the tokens it generated (vLLM's rule).
    steps = "vllm:iteration_tokens_total"
    expected = 2 * cmpl.usage.prompt_tokens + chat.usage.prompt_tokens + 13
    assert _sample(after, steps, steps + "_sum") - _sample(before, steps, steps + "_sum") == expected
    assert _sample(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total") \
        - _sample(before, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == expected - 13

    # TTFT is clocked from arrival: it covers the queue and prefill phases of the same sequences.
    def grew(name: str) -> float:
        return _sample(after, name, name + "_sum") - _sample(before, name, name + "_sum")

    assert grew("vllm:time_to_first_token_seconds") >= 0.99 * (
        grew("vllm:request_queue_time_seconds") + grew("vllm:request_prefill_time_seconds"))
    assert grew("vllm:request_inference_time_seconds") == pytest.approx(
        grew("vllm:request_prefill_time_seconds") + grew("vllm:request_decode_time_seconds"), abs=1e-3)
