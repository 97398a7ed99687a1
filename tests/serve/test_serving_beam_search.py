"""use_beam_search on the shared server (completions and chat) against transformers' beam search,
return_token_ids, and priority refused under fcfs."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers.tiny_models import load_hf_model
from tests.serve.conftest import SERVED_MODEL, metric, wait_for

pytestmark = pytest.mark.timeout(600)
CHAT = [{"role": "user", "content": "Name a colour"}]


@pytest.fixture(scope="module")
def http(real_server):
    with httpx.Client(base_url=real_server.base, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def hf_beams(real_server):
    model = load_hf_model(real_server.model_path)
    model.generation_config.eos_token_id = None  # as ignore_eos: no beam ends early
    model.generation_config.pad_token_id = 0

    def beams(prompt_ids: list[int], width: int, max_tokens: int) -> list[list[int]]:
        out = model.generate(torch.tensor([prompt_ids]), num_beams=width, do_sample=False,
                             max_new_tokens=max_tokens, num_return_sequences=width)
        return [s[len(prompt_ids):].tolist() for s in out]

    return beams


def _post(http: httpx.Client, endpoint: str, **body) -> httpx.Response:
    return http.post(endpoint, json={"model": SERVED_MODEL, **body})


@pytest.mark.parametrize("width", [2, 4])
def test_completion_beams_equal_transformers(http, hf_beams, width):
    r = _post(http, "/v1/completions", prompt="The capital of France is", n=width, use_beam_search=True,
              max_tokens=8, temperature=0.0, ignore_eos=True, return_token_ids=True, logprobs=1)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    prompt_ids = choices[0]["prompt_token_ids"]
    assert [c["token_ids"] for c in choices] == hf_beams(prompt_ids, width, 8)
    assert [c["index"] for c in choices] == list(range(width))
    assert all(c["finish_reason"] == "length" and len(c["logprobs"]["tokens"]) == 8 for c in choices)
    # Best first: the sums of the chosen tokens' logprobs fall.
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums == sorted(sums, reverse=True)
    assert r.json()["usage"]["completion_tokens"] == 8 * width


def test_chat_beams_and_prompt_token_ids(http, hf_beams):
    r = _post(http, "/v1/chat/completions", messages=CHAT, n=3, use_beam_search=True, max_tokens=6,
              temperature=0.0, ignore_eos=True, return_token_ids=True, length_penalty=0.7)
    assert r.status_code == 200, r.text
    body = r.json()
    beams = hf_beams(body["prompt_token_ids"], 3, 6)
    assert [c["token_ids"] for c in body["choices"]] == beams
    assert len({c["message"]["content"] for c in body["choices"]}) == 3
    # Without return_token_ids the responses keep their shape.
    plain = _post(http, "/v1/chat/completions", messages=CHAT, n=2, use_beam_search=True, max_tokens=2).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_beam_search_refusals(http, endpoint):
    base = {"prompt": "Hi"} if endpoint == "/v1/completions" else {"messages": CHAT}
    for body, param, needle in [
        ({"stream": True}, "stream", "does not support streaming"),
        ({"n": 11}, "n", "n=11 needs 2 x n = 22 logprobs"),
        ({"response_format": {"type": "json_object"}}, "use_beam_search", "output constraints"),
        ({"priority": 1}, "priority", "needs --scheduling-policy priority"),
        ({"length_penalty": "long"}, None, "length_penalty"),
    ]:
        r = _post(http, endpoint, **base, use_beam_search=True, max_tokens=2, **{"n": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"], r.text
        if param is not None:
            assert r.json()["error"]["param"] == param
    assert _post(http, endpoint, **base, max_tokens=2, length_penalty=0.5).status_code == 200  # ignored
    assert _post(http, endpoint, **base, use_beam_search=True, n=2, max_tokens=2).status_code == 200


def test_return_token_ids_in_streams(http, real_server):
    with http.stream("POST", "/v1/completions", json={"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 5,
                                                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                                                       "return_token_ids": True}) as r:
        chunks = [__import__("json").loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    full = _post(http, "/v1/completions", prompt="Hello", max_tokens=5, temperature=0.0, ignore_eos=True,
                 return_token_ids=True).json()["choices"][0]
    assert ids == full["token_ids"] and len(ids) == 5
    assert chunks[0]["choices"][0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch for c in chunks[1:] for ch in c["choices"])


@pytest.mark.parametrize("priority", [2 ** 63, -(2 ** 63) - 1, 1.5, "high", True])
def test_hostile_priority(http, priority):
    r = _post(http, "/v1/completions", prompt="Hi", max_tokens=1, priority=priority)
    assert r.status_code == 400, r.text
    assert "priority" in r.text
    assert _post(http, "/v1/completions", prompt="Hi", max_tokens=1, priority=0).status_code == 200


def test_extreme_length_penalty_and_a_vanished_client_leak_nothing(http, real_server):
    for penalty in (1e308, -1e308):
        r = _post(http, "/v1/completions", prompt="Hi", n=2, use_beam_search=True, max_tokens=3,
                  length_penalty=penalty)
        assert r.status_code == 200, r.text
    # A client that leaves mid-search: the step's beam requests are aborted, their blocks freed.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(real_server.base + "/v1/completions", timeout=0.5, json={
            "model": SERVED_MODEL, "prompt": "The capital of France is", "n": 4, "use_beam_search": True,
            "max_tokens": 200, "ignore_eos": True})

    def idle() -> bool:
        # A request of our own first: the core's load is read with its outputs (a front end with
        # nothing open does not listen to the core).
        assert _post(http, "/v1/completions", prompt="Hi", max_tokens=1).status_code == 200
        values = real_server.metrics()
        return (metric(values, "vllm:num_requests_running") == 0 and metric(values, "vllm:num_requests_waiting") == 0
                and metric(values, "vllm:kv_cache_usage_perc") == 0.0)

    assert wait_for(idle, timeout=30)
