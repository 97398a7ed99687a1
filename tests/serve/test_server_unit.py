"""The HTTP layer over FakeLLMEngine (a unit-test double): error codes, auth, robustness,
disconnects, engine death, metrics format. The model-backed behaviour is in test_real_engine.py."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

from tests.serve.conftest import metric, wait_for

pytestmark = pytest.mark.timeout(120)


def _model(server) -> str:
    return server.app.state.served_model_names[0]


def test_models_health_version_tokenize(fake_server_factory):
    server = fake_server_factory(["--served-model-name", "tiny", "alias"])
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
    with server.http() as http:
        assert http.get("/health").status_code == 200
        assert "version" in http.get("/version").json()
        tok = http.post("/tokenize", json={"model": "alias", "prompt": "the quick brown fox"}).json()
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
        text = http.post("/detokenize", json={"model": "tiny", "tokens": tok["tokens"]}).json()["prompt"]
        assert text == "the quick brown fox"
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["count"] > 3
    # Either served name works for generation.
    out = client.completions.create(model="alias", prompt="hi", max_tokens=3, temperature=0)
    assert out.model == "alias" and out.usage.completion_tokens == 3


def test_error_codes_and_body(fake_server_factory):
    server = fake_server_factory(max_model_len=64)
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as e:  # pydantic validation: 400, not 422
        client.completions.create(model=_model(server), prompt="hi", temperature=-1.0)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=_model(server), prompt="word " * 100, max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # SamplingParams' own validation
        client.completions.create(model=_model(server), prompt="hi", max_tokens=4, extra_body={"min_tokens": 9})
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        body = r.json()
        assert r.status_code == 404 and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == 404 and body["error"]["type"] == "NotFoundError"
        r = http.post("/v1/completions", json={"model": _model(server), "prompt": "x", "max_tokens": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_api_key(fake_server_factory):
    server = fake_server_factory(["--api-key", "sekrit"])
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").completions.create(model=_model(server), prompt="hi", max_tokens=2)
    assert e.value.status_code == 401
    with server.http() as http:
        r = http.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert http.get("/health").status_code == 200  # probes stay open
    ok = server.client(api_key="sekrit").completions.create(model=_model(server), prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_queue_full_is_429(fake_server_factory):
    server = fake_server_factory(max_num_seqs=1, max_num_queued_reqs=1, step_delay=0.01)
    client = server.client()

    def one(i: int) -> str:
        try:
            client.completions.create(model=_model(server), prompt=f"p{i}", max_tokens=20)
            return "ok"
        except openai.RateLimitError as e:
            assert e.status_code == 429
            return "429"

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert "ok" in results and "429" in results, results
    assert server.http().get("/health").status_code == 200


def test_malformed_burst_keeps_server_healthy(fake_server_factory):
    server = fake_server_factory()
    model = _model(server)
    bad_bodies: list[bytes | dict] = [
        b"{not json",
        b"\xff\xfe\x00garbage",  # invalid UTF-8
        json.dumps({"model": model, "prompt": "hi", "max_tokens": "many"}).encode(),
        b"[1, 2, 3]",
        b"",
        {"model": model, "prompt": "hi", "max_tokens": -5},
        {"model": model, "prompt": "hi", "n": 10**9},
        {"model": model, "prompt": "hi", "temperature": "hot"},
        {"model": model, "prompt": {"nested": True}},
        {"model": model, "prompt": []},
        {"model": model, "prompt": [10**9]},
        {"model": model, "prompt": "hi", "logprobs": 10**6},
        {"model": model, "prompt": "hi", "logit_bias": {"abc": 1}},
        {"model": model, "prompt": "hi", "stop": [""]},
        {"model": model, "prompt": "hi", "top_p": 0},
        b'{"model": "%s", "prompt": "caf\xe9 \xff"}' % model.encode(),  # invalid UTF-8 in a string
        b'{"model": "%s", "prompt": "lone \\udcff surrogate"}' % model.encode(),
        {"model": model, "messages": []},
        {"model": model, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"model": model, "messages": "hello"},
    ]
    with server.http() as http:
        for _ in range(3):
            for body in bad_bodies:
                path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
                if isinstance(body, bytes):
                    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
                else:
                    r = http.post(path, json=body)
                assert r.status_code == 400, (body, r.status_code, r.text)
                assert r.json()["error"]["code"] == 400
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_disconnect_aborts_and_frees_blocks(fake_server_factory):
    # With --api-key: the auth middleware must pass disconnects through.
    server = fake_server_factory(["--api-key", "k"], step_delay=0.005)
    model = _model(server)
    auth = {"Authorization": "Bearer k"}

    def start_and_drop(i: int) -> int:
        body = {"model": model, "prompt": f"drop {i}", "max_tokens": 10_000, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=server.base, timeout=30, headers=auth) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 6:
                        return n  # leaving the block closes the connection mid-stream
        return -1

    with cf.ThreadPoolExecutor(4) as pool:
        assert all(n >= 6 for n in pool.map(start_and_drop, range(4)))
    assert wait_for(lambda: metric(server.metrics(), "vllm:num_requests_running") == 0)
    values = server.metrics()
    assert metric(values, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(values, "vllm:request_success_total", finished_reason="abort") == 4
    # Non-streaming requests are aborted too when their client goes away.
    body = {"model": model, "prompt": "slow", "max_tokens": 10_000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=0.5, headers=auth)
    assert wait_for(lambda: server.engine.get_num_unfinished_requests() == 0)
    assert wait_for(lambda: metric(server.metrics(), "vllm:num_requests_running") == 0)


def test_metrics_histograms(fake_server_factory):
    server = fake_server_factory()
    client = server.client()
    stream = client.completions.create(model=_model(server), prompt="hi", max_tokens=5, stream=True)
    assert len("".join(c.choices[0].text for c in stream if c.choices)) > 0
    client.completions.create(model=_model(server), prompt="hi", max_tokens=40, stop=["lazy"])
    text = httpx.get(server.base + "/metrics").text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    values = server.metrics()
    name = _model(server)
    assert metric(values, "vllm:time_to_first_token_seconds_count", model_name=name) == 2
    assert metric(values, "vllm:inter_token_latency_seconds_count", model_name=name) >= 4
    assert metric(values, "vllm:e2e_request_latency_seconds_count", model_name=name) == 2
    assert metric(values, "vllm:request_success_total", finished_reason="length") == 1
    assert metric(values, "vllm:request_success_total", finished_reason="stop") == 1
    assert metric(values, "vllm:generation_tokens_total", model_name=name) >= 5
    assert metric(values, 'vllm:time_to_first_token_seconds_bucket', le="+Inf") == 2


def test_engine_death_fails_requests_and_health(fake_server_factory):
    server = fake_server_factory(step_delay=0.01)
    client = server.client()
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.completions.create, model=_model(server), prompt="hi", max_tokens=10_000)
        assert wait_for(lambda: server.engine.get_num_unfinished_requests() == 1)
        server.engine.engine.fail_on_step = RuntimeError("device lost")
        with pytest.raises(openai.APIStatusError) as e:
            fut.result(timeout=30)
    assert e.value.status_code == 503
    assert httpx.get(server.base + "/health").status_code == 503
    with pytest.raises(openai.APIStatusError):
        client.completions.create(model=_model(server), prompt="hi", max_tokens=2)


def test_streaming_error_after_start_is_reported_in_stream(fake_server_factory):
    server = fake_server_factory(step_delay=0.01)
    body = {"model": _model(server), "prompt": "hi", "max_tokens": 10_000, "stream": True}
    events = []
    with httpx.Client(base_url=server.base, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        server.engine.engine.fail_on_step = RuntimeError("boom")
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 503
    time.sleep(0.05)


def test_hostile_fields_get_400_naming_them_and_the_engine_goes_on(fake_server_factory):
    server = fake_server_factory()
    model = _model(server)
    bodies = {
        "request_id": '{"model": "%s", "prompt": "hi", "max_tokens": 2, "request_id": "x\\ud800"}' % model,
        "temperature": '{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": Infinity}' % model,
        "repetition_penalty": '{"model": "%s", "prompt": "hi", "max_tokens": 2, "repetition_penalty": NaN}' % model,
        "stop": '{"model": "%s", "prompt": "hi", "max_tokens": 2, "stop": ["\\udfff"]}' % model,
    }
    with server.http() as http:
        for field, body in bodies.items():
            r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (field, r.text)
            assert field in r.json()["error"]["message"], (field, r.text)
        assert http.get("/health").status_code == 200
    out = server.client().completions.create(model=model, prompt="hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
