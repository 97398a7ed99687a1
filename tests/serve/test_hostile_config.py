"""Server flags against careless and hostile clients (issue 17), on the fake engine: request chat
templates refused unless --trust-request-chat-template (then sandboxed, with a deadline), the API
key on every route but the probes (--guard-probes for those too), CORS and --root-path wired."""

from __future__ import annotations

import time

import httpx
import pytest

from jaxlm.serve.chat_template import TemplateTimeoutError, render_sandboxed

pytestmark = pytest.mark.timeout(120)
MESSAGES = [{"role": "user", "content": "hi there"}]
LOOP = "{% for i in range(100000) %}{% for j in range(1000) %}x{% endfor %}{% endfor %}"


def test_request_templates_are_refused_without_the_flag(fake_server_factory, tiny_tokenizer_dir):
    srv = fake_server_factory()
    http = srv.http()
    for extra in ({"chat_template": "{{ messages }}"}, {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}):
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra})
        assert r.status_code == 400, r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "chat_template"
        r = http.post("/tokenize", json={"messages": MESSAGES, **extra})
        assert r.status_code == 400 and "--trust-request-chat-template" in r.text
    assert http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200


def test_trusted_request_template_renders_like_the_models_own(fake_server_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_tokenizer_dir).chat_template
    http = fake_server_factory(["--trust-request-chat-template"]).http()
    plain = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    sandboxed = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": own}).json()["tokens"]
    assert sandboxed == plain
    other = http.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {
        "chat_template": "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"}}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": other}).json()["prompt"] == "HI THERE"


def test_a_looping_template_stops_at_its_deadline():
    start = time.monotonic()
    with pytest.raises(TemplateTimeoutError):
        render_sandboxed(LOOP, {}, timeout_s=0.3)
    assert time.monotonic() - start < 2


def test_a_looping_request_template_fails_that_request_only(fake_server_factory):
    srv = fake_server_factory(["--trust-request-chat-template", "--chat-template-timeout", "0.5"])
    http = srv.http()
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": LOOP})
    assert r.status_code == 400 and "longer than 0.5 s" in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200


def test_api_key_guards_all_but_probes_and_guard_probes_guards_those(fake_server_factory):
    open_probes = fake_server_factory(["--api-key", "k1", "k2"]).http()
    for path in ("/health", "/version", "/metrics"):
        assert open_probes.get(path).status_code == 200
    assert open_probes.get("/v1/models").status_code == 401
    assert open_probes.post("/tokenize", json={"prompt": "hi"}).status_code == 401
    assert open_probes.get("/openapi.json").status_code == 401
    for auth in ("Bearer k1", "bearer k2", "BEARER  k1"):
        assert open_probes.get("/v1/models", headers={"authorization": auth}).status_code == 200, auth
    for auth in ("Bearer k3", "Basic k1", "k1", "Bearer"):
        assert open_probes.get("/v1/models", headers={"authorization": auth}).status_code == 401, auth
    guarded = fake_server_factory(["--api-key", "k1", "--guard-probes"]).http()
    assert guarded.get("/health").status_code == 401
    assert guarded.get("/health", headers={"authorization": "Bearer k1"}).status_code == 200


def test_cors_and_root_path(fake_server_factory):
    srv = fake_server_factory(["--allowed-origins", '["https://app.example"]', "--root-path", "/api",
                               "--api-key", "k"])
    http = srv.http()
    pre = http.options("/v1/models", headers={"origin": "https://app.example",
                                              "access-control-request-method": "GET"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    other = http.options("/v1/models", headers={"origin": "https://evil.example",
                                                "access-control-request-method": "GET"})
    assert "access-control-allow-origin" not in other.headers
    assert http.get("/health").status_code == 200  # a probe, also under --root-path
    assert http.get("/v1/models").status_code == 401
    spec = http.get("/openapi.json", headers={"authorization": "Bearer k"}).json()
    assert spec["servers"] == [{"url": "/api"}]


def test_body_limit_and_prompt_cap(fake_server_factory):
    http = fake_server_factory(["--max-request-body-bytes", "2000", "--max-prompts-per-request", "2"]).http()
    r = http.post("/v1/completions", json={"prompt": "x" * 3000})
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    chunked = http.post("/v1/completions", content=iter([b'{"prompt": "', b"y" * 1500, b"y" * 1500, b'"}']),
                        headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert r.status_code == 400 and "--max-prompts-per-request" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}).status_code == 200


def test_n_times_prompts_counts_against_the_queue(fake_server_factory):
    # 8 slots + 4 queued: 2 prompts x n=6 = 12 fit, 2 x 7 = 14 do not (refused before any is queued).
    srv = fake_server_factory(max_num_seqs=8, max_num_queued_reqs=4)
    http = srv.http()
    assert http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 6, "max_tokens": 2}).status_code == 200
    r = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 7, "max_tokens": 2})
    assert r.status_code == 429, r.text
    assert httpx.get(srv.base + "/health").status_code == 200


def test_tls_from_ssl_flags(fake_server_factory, tmp_path):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed: cannot make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    srv = fake_server_factory(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    https = srv.base.replace("http://", "https://")
    assert httpx.get(https + "/health", verify=False).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(srv.base + "/health", timeout=5)  # plain HTTP is not served
