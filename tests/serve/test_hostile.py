"""Hostile and careless clients against a real `python -m jaxlm.serve` process on a tiny model
(issue 17): every case gets a clean 4xx (never a 5xx), /health stays 200, a fixed greedy request
returns exactly what it did before, and the event loop stays free (shown by the order answers
come back in). One server process is shared by every case; it ends with Ctrl-C (exit 0)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)
KEY = "sekrit-key"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1_000_000
TEMPLATE_TIMEOUT_S = 4.0  # long enough that a /health sent meanwhile returns first, even on a loaded machine
GREEDY = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0,
          "ignore_eos": True}
MAX_LOGPROBS = 30  # above OpenAI's 20: the server's cap is the engine's --max-logprobs
LOOP_TEMPLATE = "{% for i in range(100000) %}{% for j in range(1000) %}x{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(tiny_llama, [
        "--served-model-name", "tiny", "--api-key", KEY, "--trust-request-chat-template",
        "--chat-template-timeout", str(TEMPLATE_TIMEOUT_S), "--max-request-body-bytes", str(BODY_LIMIT),
        "--request-header-timeout", "2", "--max-prompts-per-request", "16", "--max-num-queued-reqs", "32",
        "--max-logprobs", str(MAX_LOGPROBS)])
    yield srv
    code = srv.stop(signal.SIGINT)  # Ctrl-C: drains and exits like SIGTERM, no traceback
    out = srv.output()
    assert code == 0 and "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def greedy_text(http):
    r = http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _raw(body: str) -> dict:
    return {"content": body.encode("utf-8", "surrogatepass"), "headers": {"content-type": "application/json"}}


def _completion(**fields) -> dict:
    return {"json": {**GREEDY, "max_tokens": 4, **fields}}


def _chat(**fields) -> dict:
    return {"json": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}}


# (name, method, path, httpx kwargs, expected status or statuses)
CASES: list[tuple[str, str, str, dict, int | tuple[int, ...]]] = [
    ("lone surrogate request_id", "POST", "/v1/completions",
     _raw(json.dumps({**GREEDY, "request_id": "x"}).replace('"x"', '"\\ud800"')), 400),
    ("lone surrogate prompt", "POST", "/v1/completions", _raw(json.dumps(GREEDY).replace("France", "\\udfff")), 400),
    ("top_k 2**64 sampled (clamps)", "POST", "/v1/completions", _completion(top_k=2**64, temperature=0.7), 200),
    ("top_k 2**31 sampled (clamps)", "POST", "/v1/completions", _completion(top_k=2**31, temperature=0.7), 200),
    ("temperature Infinity", "POST", "/v1/completions", _raw(json.dumps(GREEDY)[:-1] + ', "temperature": Infinity}'), 400),
    ("repetition_penalty NaN", "POST", "/v1/completions", _raw(json.dumps(GREEDY)[:-1] + ', "repetition_penalty": NaN}'), 400),
    ("logit_bias NaN", "POST", "/v1/completions", _raw(json.dumps(GREEDY)[:-1] + ', "logit_bias": {"5": NaN}}'), 400),
    ("10,000 stop strings", "POST", "/v1/completions", _completion(stop=[f"s{i}" for i in range(10_000)]), 400),
    ("10,000 unknown fields", "POST", "/v1/completions", _completion(**{f"x{i}": i for i in range(10_000)}), 200),
    ("seed 2**70", "POST", "/v1/completions", _completion(seed=2**70), 400),
    ("negative max_tokens", "POST", "/v1/completions", _completion(max_tokens=-1), 400),
    ("out-of-vocab token ids", "POST", "/v1/completions", _completion(prompt=[5, 10**9]), 400),
    ("negative token ids", "POST", "/v1/completions", _completion(prompt=[-1, 5]), 400),
    ("empty prompt", "POST", "/v1/completions", _completion(prompt=""), 400),
    ("logprobs 10**9", "POST", "/v1/completions", _completion(logprobs=10**9), 400),
    ("echo + logprobs 2**54", "POST", "/v1/completions", _completion(echo=True, logprobs=2**54), 400),
    ("logprobs over --max-logprobs", "POST", "/v1/completions", _completion(logprobs=MAX_LOGPROBS + 1), 400),
    ("logprobs past OpenAI's 20, within --max-logprobs", "POST", "/v1/completions",
     _completion(logprobs=MAX_LOGPROBS - 5, echo=True), 200),
    ("top_logprobs over --max-logprobs", "POST", "/v1/chat/completions",
     _chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), 400),
    ("n 10**6", "POST", "/v1/completions", _completion(n=10**6), 400),
    ("too many prompts", "POST", "/v1/completions", _completion(prompt=["a b"] * 17), 400),
    ("n x prompts past the queue", "POST", "/v1/completions", _completion(prompt=["a b"] * 16, n=8), 429),
    ("unknown model", "POST", "/v1/completions", _completion(model="gpt-9"), 404),
    ("not JSON", "POST", "/v1/completions", _raw("{not json"), 400),
    ("JSON array body", "POST", "/v1/completions", _raw("[1, 2, 3]"), 400),
    ("deeply nested JSON", "POST", "/v1/completions", _raw('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"), 400),
    ("image content part", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400),
    ("request template 10**(10**8)", "POST", "/v1/chat/completions", _chat(chat_template="{{ 10 ** 100000000 }}"), 400),
    ("request template repeats 10**9", "POST", "/v1/chat/completions",
     _chat(chat_template_kwargs={"chat_template": "{{ 'x' * 1000000000 }}"}), 400),
    ("request template attribute escape", "POST", "/v1/chat/completions",
     _chat(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"), 400),
    ("request template that raises", "POST", "/v1/chat/completions",
     _chat(chat_template="{{ raise_exception('no') }}"), 400),
    ("body over the limit (Content-Length)", "POST", "/v1/completions",
     _raw(json.dumps({**GREEDY, "prompt": "a" * (BODY_LIMIT + 10)})), 413),
    ("chunked body over the limit", "POST", "/v1/completions",
     {"content": iter([b'{"prompt": "'] + [b"a" * 65536] * 20 + [b'"}']),
      "headers": {"content-type": "application/json"}}, 413),
    ("tokenize without a key", "POST", "/tokenize", {"json": {"prompt": "hi"}, "headers": {"authorization": ""}}, 401),
    ("detokenize with a wrong key", "POST", "/detokenize",
     {"json": {"tokens": [5]}, "headers": {"authorization": "Bearer nope"}}, 401),
    ("models with a wrong scheme", "GET", "/v1/models", {"headers": {"authorization": f"Basic {KEY}"}}, 401),
    ("lower-case bearer", "POST", "/tokenize", {"json": {"prompt": "hi"}, "headers": {"authorization": f"bearer {KEY}"}}, 200),
    ("detokenize out-of-vocab", "POST", "/detokenize", {"json": {"tokens": [10**9]}}, 400),
    ("unknown route", "GET", "/v1/nothing", {}, 404),
    ("wrong method", "GET", "/v1/completions", {}, 405),
]


def test_hostile_cases_get_clean_4xx_and_leave_the_server_healthy(server, http, greedy_text):
    held, failures = 0, []
    plain = httpx.Client(base_url=server.base, timeout=120)  # no default key: each case sends its own
    for name, method, path, kwargs, expected in CASES:
        kw = dict(kwargs)
        headers = {**AUTH, **kw.pop("headers", {})}
        try:
            r = plain.request(method, path, headers={k: v for k, v in headers.items() if v}, **kw)
        except httpx.HTTPError as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
            continue
        ok = r.status_code in (expected if isinstance(expected, tuple) else (expected,)) and r.status_code < 500
        if r.status_code >= 400:
            ok = ok and "error" in r.json()  # an OpenAI error object, naming the problem
        health = httpx.get(server.base + "/health", timeout=10).status_code
        if ok and health == 200:
            held += 1
        else:
            failures.append(f"{name}: {r.status_code} (expected {expected}), /health {health}: {r.text[:200]}")
    plain.close()
    print(f"\nhostile cases held: {held} of {len(CASES)}")
    assert not failures, "\n".join(failures)
    assert http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == greedy_text


def test_probes_are_open_and_version_is_the_package_version(server):
    import jaxlm

    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/metrics").status_code == 200
    assert httpx.get(server.base + "/version").json() == {"version": jaxlm.__version__}
    # --uvicorn-log-level warning (TINY_ENGINE_FLAGS): none of uvicorn's info lines (test_cli: the default).
    assert "Application startup complete" not in server.output() and "Uvicorn running" not in server.output()


def test_slow_headers_are_cut_off(server, http, greedy_text):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
        start = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - start < 8
    assert http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == greedy_text


class HealthProbe:
    """Polls /health from a thread; latencies of every answer, and when each came back."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=30) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                self.latencies.append(time.perf_counter() - t)
                time.sleep(0.01)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def p99(self) -> float:
        values = sorted(self.latencies)
        return values[min(len(values) - 1, int(0.99 * len(values)))]


def _answered_first(server, send_slow: Callable[[httpx.Client, threading.Event], int], ok: set[int]) -> None:
    """A /health sent while `send_slow` runs (it sets `running` once it is under way) is
    answered before it completes."""
    order: list[str] = []
    running, done = threading.Event(), threading.Event()

    def slow() -> None:
        with httpx.Client(base_url=server.base, headers=AUTH, timeout=120) as c:
            status = send_slow(c, running)
        assert status in ok
        order.append("slow")
        done.set()

    thread = threading.Thread(target=slow)
    t0 = time.perf_counter()
    thread.start()
    assert running.wait(60)
    assert not done.is_set(), "the slow request was not slow enough to show anything"
    t1 = time.perf_counter()
    assert httpx.get(server.base + "/health", timeout=30).status_code == 200
    order.append("health")
    t2 = time.perf_counter()
    thread.join()
    t3 = time.perf_counter()
    assert order == ["health", "slow"], (f"under way at {t1 - t0:.2f} s, /health took {t2 - t1:.2f} s, "
                                         f"the slow request ended at {t3 - t0:.2f} s")


def _post_after(delay: float, path: str, body: dict) -> Callable[[httpx.Client, threading.Event], int]:
    """Posts; says it is under way `delay` seconds later (being read, tokenized or rendered)."""
    def send(c: httpx.Client, running: threading.Event) -> int:
        threading.Timer(delay, running.set).start()
        return c.post(path, json=body).status_code
    return send


def _stream(body: dict) -> Callable[[httpx.Client, threading.Event], int]:
    """Streams; under way once the first chunk arrived (the rest is still being generated)."""
    def send(c: httpx.Client, running: threading.Event) -> int:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for _ in r.iter_lines():
                running.set()
            return r.status_code
    return send


def test_event_loop_stays_free(server):
    big_prompt = ("The capital of France is Paris. 日本語 🙂 " * 40_000)[: BODY_LIMIT // 2 - 100]
    assert len(json.dumps({"prompt": big_prompt}).encode()) < BODY_LIMIT
    with HealthProbe(server.base) as probe:
        _answered_first(server, _post_after(0.05, "/v1/completions", {**GREEDY, "prompt": big_prompt}), {400})
        _answered_first(server, _post_after(0.05, "/v1/chat/completions", _chat(chat_template=LOOP_TEMPLATE)["json"]),
                        {400})
        stops = [f"zz{i}q" * 8 for i in range(256)]  # the most admission allows
        _answered_first(server, _stream({**GREEDY, "max_tokens": 110, "stop": stops}), {200})
    print(f"\n/health p99 during the large-body, template and stop-string cases: {1000 * probe.p99():.1f} ms "
          f"over {len(probe.latencies)} probes")
    assert probe.p99() < TEMPLATE_TIMEOUT_S / 2


def test_request_ids_reused_after_disconnect_and_shared_while_live(server, http):
    prompts = ["The quick brown fox", "Hello, my name is"]
    want = [http.post("/v1/completions", json={**GREEDY, "prompt": p, "max_tokens": 8}).json()["choices"][0]["text"]
            for p in prompts]
    assert want[0] != want[1]
    for i in range(30):
        rid = f"same-{i % 3}"
        with http.stream("POST", "/v1/completions", json={
                **GREEDY, "prompt": prompts[0], "max_tokens": 100, "stream": True, "request_id": rid}) as r:
            next(r.iter_lines())  # one chunk, then the client goes away
        again = http.post("/v1/completions", json={**GREEDY, "prompt": prompts[1], "max_tokens": 8, "request_id": rid})
        assert again.json()["choices"][0]["text"] == want[1]
        results: list = [None, None]

        def run(k: int) -> None:
            with httpx.Client(base_url=server.base, headers=AUTH, timeout=60) as c:
                results[k] = c.post("/v1/completions", json={**GREEDY, "prompt": prompts[k], "max_tokens": 8,
                                                             "request_id": rid}).json()["choices"][0]["text"]

        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == want
