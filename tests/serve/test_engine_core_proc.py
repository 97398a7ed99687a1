"""The server's engine cores in their own processes (one server, -dp 2): both cores serve and
/metrics shows each one's series (vLLM's `engine` label) beside the total; an engine core killed
mid-stream (SIGKILL) ends the open streams with an error, /health never answers 200 again and the
server exits non-zero within 10 s, leaving no child process."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest

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
    per_engine = {k: v for k, v in values.items() if k.startswith("vllm:prefix_cache_queries_total{engine=")}
    assert len(per_engine) == 2 and all(v > 0 for v in per_engine.values()), per_engine
    assert values['vllm:prefix_cache_queries_total{model_name="tiny"}'] == sum(per_engine.values())


def _health(base: str) -> int | None:
    """/health's status, or None once the server refuses connections (it may exit that fast)."""
    try:
        return httpx.get(base + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_dp2_server_then_a_killed_engine_core_ends_streams_and_the_server_exits(tiny_llama):
    srv = ServerProcess(tiny_llama, ["--served-model-name", "tiny", "-dp", "2"])
    try:
        children = [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)]
        cores = [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(cores) == 2
        _both_cores_serve(srv)
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
