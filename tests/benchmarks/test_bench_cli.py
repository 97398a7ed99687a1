"""`jaxlm bench serve|throughput|latency` end to end on a tiny model: each writes vLLM's result
keys; `serve` against a real jaxlm server, paced (--request-rate) and capped
(--max-concurrency), completes every request; bad input fails in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.tiny_models import make_tiny_llama
from tests.serve.server_process import REPO, TINY_ENGINE_FLAGS, ServerProcess, free_port

# vLLM's result keys (vllm/benchmarks/serve.py, throughput.py, latency.py) that jaxlm writes.
VLLM_SERVE_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl")),
}
VLLM_THROUGHPUT_KEYS = {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"}
VLLM_LATENCY_KEYS = {"avg_latency", "std_latency", "latencies", "percentiles"}
# The engine part of the test server's flags: the offline subcommands build the same small engine.
ENGINE_FLAGS = TINY_ENGINE_FLAGS[:TINY_ENGINE_FLAGS.index("--uvicorn-log-level")]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}


def bench(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxlm.bench", *argv], capture_output=True, text=True,
                          env=ENV, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("bench-cli") / "model")


@pytest.fixture(scope="module")
def server(model):
    srv = ServerProcess(model, ["--no-defer-program-load"])
    yield srv
    srv.stop()


def _serve_args(server, model, out_dir, *extra: str) -> list[str]:
    return ["serve", "--base-url", server.base, "--tokenizer", model, "--disable-tqdm", "--save-result",
            "--result-dir", str(out_dir), "--result-filename", "r.json", *extra]


def test_serve_paced_and_capped_completes_every_request(server, model, tmp_path):
    r = bench(*_serve_args(server, model, tmp_path, "--dataset-name", "random", "--random-input-len", "12",
                           "--random-output-len", "6", "--random-range-ratio", "0.5", "--num-prompts", "10",
                           "--max-concurrency", "3", "--request-rate", "20", "--burstiness", "0.5",
                           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Serving Benchmark Result" in r.stdout and "Median TTFT (ms):" in r.stdout
    res = json.loads((tmp_path / "r.json").read_text())
    assert VLLM_SERVE_KEYS <= set(res), VLLM_SERVE_KEYS - set(res)
    assert {"p50_e2el_ms", "p99_e2el_ms", "mean_e2el_ms"} <= set(res)
    assert res["completed"] == res["num_prompts"] == 10 and res["failed"] == 0
    assert res["max_concurrency"] == 3 and res["request_rate"] == 20 and res["burstiness"] == 0.5
    assert "ttfts" not in res  # per-request lists only with --save-detailed, as vLLM
    # random prompts ignore EOS: every request generated what it asked for (lengths within 3..9).
    assert 10 * 3 <= res["total_output_tokens"] <= 10 * 9
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration"])
    assert 0 < res["median_ttft_ms"] <= res["p99_ttft_ms"] <= res["p99_e2el_ms"]


def test_serve_chat_endpoint_custom_dataset_detailed(server, model, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}.", "output_len": 4}) + "\n"
                            for i in range(5)))
    r = bench(*_serve_args(server, model, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "custom",
                           "--dataset-path", str(data), "--num-prompts", "5", "--max-concurrency", "2",
                           "--save-detailed", "--ignore-eos"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["backend"] == "openai-chat" and res["completed"] == 5 and res["failed"] == 0
    assert res["output_lens"] == [4] * 5 and res["total_output_tokens"] == 20
    # A gap per text chunk after the first: at most 3 for 4 tokens (a server may merge chunks).
    assert all(len(itl) <= 3 for itl in res["itls"]) and all(t > 0 for t in res["ttfts"])


def test_bad_dataset_line_is_refused_with_its_number(model, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "fine"}\n\n{"prompt": "also fine"}\n{"text": "no prompt here"}\n')
    r = bench("serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--tokenizer", model,
              "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "3")
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1, lines
    assert f"{data}:4:" in lines[0] and "'prompt'" in lines[0]


def test_wrong_base_url_fails_in_one_line(model):
    url = f"http://127.0.0.1:{free_port()}"
    r = bench("serve", "--base-url", url, "--tokenizer", model, "--num-prompts", "2", timeout=60)
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("jaxlm bench serve: cannot reach " + url)


def test_throughput_writes_vllm_keys(model, tmp_path):
    out = tmp_path / "t.json"
    r = bench("throughput", "--model", model, *ENGINE_FLAGS, "--dataset-name", "random", "--random-input-len", "12",
              "--random-output-len", "5", "--num-prompts", "6", "--output-json", str(out), "--disable-tqdm")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert VLLM_THROUGHPUT_KEYS | {"request_throughput", "output_throughput", "total_token_throughput"} <= set(res)
    assert res["num_requests"] == res["completed"] == 6 and res["total_output_tokens"] == 30
    assert res["total_num_tokens"] == res["total_input_tokens"] + 30
    assert res["tokens_per_second"] == pytest.approx(res["total_num_tokens"] / res["elapsed_time"])
    assert "Throughput:" in r.stdout


def test_latency_writes_vllm_keys(model, tmp_path):
    out = tmp_path / "l.json"
    r = bench("latency", "--model", model, *ENGINE_FLAGS, "--input-len", "8", "--output-len", "4",
              "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out),
              "--disable-tqdm")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res) == VLLM_LATENCY_KEYS and len(res["latencies"]) == 3
    assert set(res["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(res["latencies"]) <= res["percentiles"]["50"] <= max(res["latencies"])


def test_serve_splits_the_stream_at_sse_line_ends_only():
    """A generated text with U+2028 / U+0085 (JSON leaves them unescaped) stays one event: a
    splitter at every str.splitlines boundary (httpx's aiter_lines) failed such a request."""
    import asyncio

    import httpx

    from jaxlm.benchmarks.serve import send_request

    texts = ["a\u2028b", "c\x85d", "e"]
    events = [json.dumps({"choices": [{"index": 0, "text": t}]}, ensure_ascii=False) for t in texts]
    events.append(json.dumps({"choices": [], "usage": {"completion_tokens": 3}}))
    body = "".join(f"data: {e}\r\n\r\n" for e in events).encode() + b"data: [DONE]\n\n"

    class Chunked(httpx.AsyncByteStream):  # 7-byte pieces: lines and characters cut across chunks
        async def __aiter__(self):
            for i in range(0, len(body), 7):
                yield body[i:i + 7]

    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=Chunked()))
        async with httpx.AsyncClient(transport=transport, base_url="http://bench.test") as client:
            return await send_request(client, "/v1/completions", {"prompt": "x"}, 1, 0.0)

    out = asyncio.run(run())
    assert out.success and not out.error, out.error
    assert out.generated_text == "".join(texts) and out.output_tokens == 3 and len(out.itl) == 2
