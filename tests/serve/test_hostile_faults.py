"""Faults inside a real `python -m jaxlm.serve` process (issue 17), injected by the test's own
launcher (tests/serve/fault_patch.py, enabled by JAXLM_TEST_FAULT): a fault in one request's
sampling inputs fails that request alone (500 error object; the others and the server go on);
a fault in the model step ends every open stream with an error event, /health never answers 200
again, and the process exits non-zero within 10 s so a supervisor restarts it. Also: a second
server on the taken port fails at once, naming it."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)
GREEDY = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0.0,
          "ignore_eos": True}


def _stream_events(base: str, body: dict, first: threading.Event, events: list) -> None:
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first.set()
    except httpx.HTTPError as e:  # the connection may go with the process
        events.append(f"closed: {type(e).__name__}")
    first.set()


def test_faults_one_request_fails_alone_then_a_model_fault_exits(tiny_llama):
    # Slow steps (50 ms) and 120-token streams (>= 6 s): the kill request reaches the engine
    # while both streams are open, however loaded the machine.
    srv = ServerProcess(tiny_llama, ["--served-model-name", "tiny"], fault_patch=True,
                        env={"JAXLM_TEST_FAULT": "poison,kill,slow"})
    try:
        http = httpx.Client(base_url=srv.base, timeout=60)
        want = http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        _second_server_on_the_port_fails_at_once(tiny_llama, srv)
        # One poisoned request among healthy ones: only it fails.
        results: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda rid=rid: results.__setitem__(
            rid, httpx.post(srv.base + "/v1/completions", json={**GREEDY, "request_id": rid}, timeout=60)))
            for rid in ("ok-1", "poison-1", "ok-2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["poison-1"].status_code == 500
        assert "poisoned sampling inputs" in results["poison-1"].json()["error"]["message"]
        assert [results[r].json()["choices"][0]["text"] for r in ("ok-1", "ok-2")] == [want, want]
        streamed = http.post("/v1/completions", json={**GREEDY, "request_id": "poison-2", "stream": True})
        assert streamed.status_code == 500  # failed before its first token: still a status
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == want

        # Two open streams, then a request that breaks the model step.
        streams = [([], threading.Event()) for _ in range(2)]
        workers = [threading.Thread(target=_stream_events, args=(
            srv.base, {**GREEDY, "max_tokens": 120, "prompt": p}, first, events))
            for (events, first), p in zip(streams, ["Hello", "The quick"])]
        for w in workers:
            w.start()
        assert all(first.wait(60) for _, first in streams)
        killed_at = time.monotonic()
        try:
            kill = httpx.post(srv.base + "/v1/completions", json={**GREEDY, "request_id": "kill"}, timeout=30)
            assert kill.status_code in (500, 503)
        except httpx.HTTPError:
            pass  # the process may already be going
        for w in workers:
            w.join(30)
        for events, _ in streams:
            errors = [e for e in events if e.startswith("{") and "error" in json.loads(e)]
            assert errors or events[-1].startswith("closed"), events[-3:]
            if errors:
                assert "injected fault: the model step failed" in json.loads(errors[0])["error"]["message"]
        while srv.proc.poll() is None and time.monotonic() - killed_at < 10:
            try:
                assert httpx.get(srv.base + "/health", timeout=2).status_code != 200
            except httpx.HTTPError:
                pass  # refused: the server is gone or going
            time.sleep(0.1)
        code = srv.proc.wait(max(0.1, 10 - (time.monotonic() - killed_at)))
        print(f"\nmodel fault: exit code {code} after {time.monotonic() - killed_at:.1f} s; stream ends: "
              f"{[events[-1][:60] for events, _ in streams]}")
        assert code != 0
    finally:
        srv.stop(signal.SIGKILL)


def _second_server_on_the_port_fails_at_once(model: str, first: ServerProcess) -> None:
    start = time.monotonic()
    second = ServerProcess(model, [], port=first.port, wait=False)
    code = second.proc.wait(60)
    out = second.output()
    assert code != 0 and f":{first.port}" in out and "Traceback" not in out, out[-2000:]
    assert time.monotonic() - start < 30  # before any model load
    assert httpx.get(first.base + "/health").status_code == 200
