"""The server's engine cores in their own processes (one server, -dp 2, started as a user would,
with --disable-log-stats and --enable-log-requests): both cores serve; every vllm: series on
/metrics carries model_name and the `engine` that did the work, and the engines' series sum to
the server's totals; dropped streams leave both cores idle with 0 running and 0 KV usage within
a heartbeat; the flags' logging. Last, an engine core killed mid-stream (SIGKILL) ends the open
streams with an error, /health never answers 200 again and the server exits non-zero within
10 s, leaving no child process."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import assert_idle_gauges, concurrent_streams
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)
BODY = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True}


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _stream(base: str, events: list[str], first: threading.Event) -> None:
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 110, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first.set()
    except httpx.HTTPError as e:  # the connection may go with the process
        events.append(f"closed: {type(e).__name__}")
    first.set()


@pytest.fixture(scope="module")
def dp2(tiny_llama):
    # Every model step 50 ms longer (fault_patch.py's "slow"): the dropped streams are still running
    # when their clients leave ("Aborted request"), and the stream the last test's SIGKILL cuts is
    # still open, however fast the machine.
    srv = ServerProcess(tiny_llama, ["--served-model-name", "tiny", "-dp", "2", "--disable-log-stats",
                                     "--enable-log-requests", "--uvicorn-log-level", "info"],
                        env={"JAXLM_LOG_STATS_INTERVAL": "0.2",  # were the stats line on, it would show
                             "JAXLM_TEST_FAULT": "slow"})
    # Each core's programs written to (or found in) the program cache: a core whose programs came
    # from JAX's cache compiles them again in the background first, which would share the CPU
    # with the timed exit of the last test.
    deadline = time.monotonic() + 300  # under the test's timeout, so a miss prints the log
    while sum(srv.output().count(s) for s in ("program cache written", "compiled programs from")) < 2:
        if time.monotonic() > deadline or srv.proc.poll() is not None:
            srv.stop(signal.SIGKILL)  # not left running past the failed setup
            pytest.fail(f"no program cache line from each core:\n{srv.log_tail()}")
        time.sleep(0.2)
    yield srv
    srv.stop(signal.SIGKILL)


def _both_cores_serve(srv: ServerProcess) -> None:
    results: list[str] = []
    threads = [threading.Thread(target=lambda i=i: results.append(httpx.post(
        srv.base + "/v1/completions", json={**BODY, "prompt": f"Number {i} is"}, timeout=120,
    ).json()["choices"][0]["text"])) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    values = srv.metrics()
    per_engine = {k: v for k, v in values.items() if k.startswith("vllm:prefix_cache_queries_total{")}
    assert per_engine.keys() == {f'vllm:prefix_cache_queries_total{{engine="{i}",model_name="tiny"}}' for i in "01"}
    assert all(v > 0 for v in per_engine.values()), per_engine


def _per_engine(families: dict, family: str, sample: str, **labels: str) -> dict[str, float]:
    """engine -> the sample's value (summed over other labels)."""
    out: dict[str, float] = {}
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def test_dp2_engine_labels_idle_gauges_and_log_flags(dp2):
    _both_cores_serve(dp2)
    # 16 long streams, all dropped after two chunks: the cores' last steps still ran them.
    prompts = [f"Number {i} is" for i in range(16)]
    concurrent_streams(dp2.base, "tiny", prompts, 100, drop=set(range(16)), temperature=0.0,
                       extra_body={"ignore_eos": True})
    assert_idle_gauges(dp2.metrics)
    families = {f.name: f for f in text_string_to_metric_families(dp2.metrics_text())}
    for family in families.values():
        if family.name.startswith("vllm:"):
            # No unlabelled total beside the engines (a sum would double it); vllm:cache_config_info
            # is labelled by the config and the engine (as vLLM's).
            for s in family.samples:
                assert s.labels.get("engine") in ("0", "1"), s
                assert s.labels.get("model_name") == "tiny" or family.name == "vllm:cache_config_info", s
    # Request-level series: each core has its own, and they sum to the server's requests.
    success = _per_engine(families, "vllm:request_success", "vllm:request_success_total")
    assert sum(success.values()) == 8 + 16 and success.keys() == {"0", "1"}
    e2e = _per_engine(families, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count")
    ttft = _per_engine(families, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count")
    assert e2e == success and all(v > 0 for v in ttft.values()) and ttft.keys() == {"0", "1"}
    for name in ("vllm:generation_tokens", "vllm:prompt_tokens"):  # counted per core's steps
        counted = _per_engine(families, name, name + "_total")
        assert counted.keys() == {"0", "1"} and all(v > 0 for v in counted.values()), (name, counted)
    assert {s.labels["num_gpu_blocks"] for s in families["vllm:cache_config_info"].samples} == {"160"}  # override
    out = dp2.output()
    assert out.count("Received request cmpl-") == 8 + 16 and "Aborted request cmpl-" in out
    assert "Avg prompt throughput" not in out  # --disable-log-stats
    # uvicorn at info, but no access log (--disable-uvicorn-access-log, in TINY_ENGINE_FLAGS).
    assert "Application startup complete" in out and "HTTP/1.1" not in out


def _health(base: str) -> int | None:
    """/health's status, or None once the server refuses connections (it may exit that fast)."""
    try:
        return httpx.get(base + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_dp2_server_then_a_killed_engine_core_ends_streams_and_the_server_exits(dp2):
    srv = dp2
    try:
        children = [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)]
        cores = [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(cores) == 2
        core = cores[0]
        events: list[str] = []
        first = threading.Event()
        worker = threading.Thread(target=_stream, args=(srv.base, events, first))
        worker.start()
        assert first.wait(60)
        core.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        # The kernel tears a many-threaded process down over some milliseconds (its process
        # sentinel closes last): /health may answer 200 until then, never after.
        while _health(srv.base) == 200:
            assert time.monotonic() - killed_at < 1.0
            time.sleep(0.005)
        while srv.proc.poll() is None and time.monotonic() - killed_at < 10:
            assert _health(srv.base) != 200  # 503, or refused: the server is gone or going
            time.sleep(0.05)
        code = srv.proc.wait(max(0.1, 10 - (time.monotonic() - killed_at)))
        worker.join(30)
        errors = [e for e in events if e.startswith("{") and "error" in json.loads(e)]
        assert errors or events[-1].startswith("closed"), events[-3:]
        if errors:
            assert "engine core" in json.loads(errors[0])["error"]["message"]
        print(f"\nengine core killed: server exit code {code} after {time.monotonic() - killed_at:.1f} s")
        assert code != 0
        deadline = time.monotonic() + 5  # multiprocessing's resource tracker goes with its parent
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(children)
    finally:
        srv.stop(signal.SIGKILL)
