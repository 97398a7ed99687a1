"""What a vLLM user's clients send works unchanged on the shared `python -m jaxlm.serve`: echo and
prompt logprobs across a multi-step prefill, scoring with max_tokens=0, every request field of
the OpenAI / vLLM schema either changes the output as specified or gets a 400 naming it."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.serve.conftest import SERVED_MODEL, SERVER_STEP_BUDGET

pytestmark = pytest.mark.timeout(600)
LONG_PROMPT = ("The capital of France is Paris. The capital of Italy is Rome. The quick brown fox jumps "
               "over the lazy dog while the cat sleeps. Hello, my name is Ada")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(real_server):
    with httpx.Client(base_url=real_server.base, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tok(real_server):
    return AutoTokenizer.from_pretrained(real_server.model_path)


def _complete(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json={"model": SERVED_MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http: httpx.Client, **body) -> list[dict]:
    events = []
    with http.stream("POST", "/v1/completions", json={"model": SERVED_MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


# ------------------------------------------------------------------ echo and prompt logprobs
def test_echo_logprobs_keep_every_prompt_position_over_a_multi_step_prefill(http, tok):
    ids = tok.encode(LONG_PROMPT, add_special_tokens=False)
    assert len(ids) > 3 * SERVER_STEP_BUDGET
    out = _complete(http, prompt=ids, echo=True, logprobs=1, max_tokens=1, **GREEDY)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None  # nothing predicts the first token
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert all(isinstance(t, dict) and t for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # Streaming sends the same positions (the echo waits for the whole prompt's logprobs).
    events = _stream(http, prompt=ids, echo=True, logprobs=1, max_tokens=1, **GREEDY)
    streamed = [v for e in events for c in e["choices"] for v in c["logprobs"]["token_logprobs"]]
    assert len(streamed) == len(lp["token_logprobs"]) and streamed[0] is None
    assert streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    assert "".join(c["text"] for e in events for c in e["choices"]) == out["choices"][0]["text"]


def test_echo_with_max_tokens_zero_scores_the_prompt_only(http, tok):
    ids = tok.encode(LONG_PROMPT, add_special_tokens=False)
    scored = _complete(http, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    choice = scored["choices"][0]
    assert choice["text"] == tok.decode(ids)
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert scored["usage"]["completion_tokens"] == 0
    with_token = _complete(http, prompt=ids, echo=True, logprobs=0, max_tokens=1, **GREEDY)
    assert with_token["choices"][0]["logprobs"]["token_logprobs"][:-1] == pytest.approx(
        [None] + choice["logprobs"]["token_logprobs"][1:], abs=1e-5)
    events = _stream(http, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert "".join(c["text"] for e in events for c in e["choices"]) == tok.decode(ids)
    # Without echo, 0 tokens is no request.
    r = http.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_field(http, tok):
    ids = tok.encode(LONG_PROMPT, add_special_tokens=False)
    out = _complete(http, prompt=ids, max_tokens=1, prompt_logprobs=2, **GREEDY)
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token_id, position in zip(ids[1:], plp[1:]):
        assert str(token_id) in position and 2 <= len(position) <= 3
        assert {"logprob", "rank", "decoded_token"} <= set(position[str(token_id)])
    # Equal to the echo path's numbers.
    echo = _complete(http, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert [p[str(t)]["logprob"] for t, p in zip(ids[1:], plp[1:])] == pytest.approx(
        echo["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-5)
    chat = http.post("/v1/chat/completions", json={
        "model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    r = http.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": "Hi", "prompt_logprobs": 1,
                                           "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# ------------------------------------------------------------------ sampling fields
def test_bad_words_and_allowed_token_ids_change_the_output(http, tok):
    # A prompt whose greedy first token is a whole word (a random model also emits byte pieces).
    for prompt in ["The capital of", "Hello, my name is", "A paged KV cache", "The quick brown", "Python", "Rome"]:
        base = _complete(http, prompt=prompt, max_tokens=1, logprobs=0, return_tokens_as_token_ids=True, **GREEDY)
        first_id = int(base["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
        word = tok.decode([first_id]).strip()
        if word and first_id in (tok.encode(word, add_special_tokens=False)
                                 + tok.encode(" " + word, add_special_tokens=False)):
            break
    else:
        pytest.fail("no prompt starts its greedy output with a whole word")
    banned = _complete(http, prompt=prompt, max_tokens=4, bad_words=[word], return_tokens_as_token_ids=True,
                       logprobs=0, **GREEDY)
    banned_ids = [int(t.split(":")[1]) for t in banned["choices"][0]["logprobs"]["tokens"]]
    assert first_id not in banned_ids
    allowed = [5, 17, 40]
    out = _complete(http, prompt="The capital of", max_tokens=6, allowed_token_ids=allowed,
                    return_tokens_as_token_ids=True, logprobs=0, **GREEDY)
    assert {int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]} <= set(allowed)


def test_return_tokens_as_token_ids(http, real_server):
    out = _complete(http, prompt="Hello, my name", max_tokens=3, logprobs=2, return_tokens_as_token_ids=True,
                    **GREEDY)
    lp = out["choices"][0]["logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"])
    assert all(re.fullmatch(r"token_id:\d+", k) for top in lp["top_logprobs"] for k in top)
    chat = real_server.client().chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True,
        top_logprobs=1, temperature=0.0, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert content and all(re.fullmatch(r"token_id:\d+", c.token) for c in content)
    assert all(re.fullmatch(r"token_id:\d+", t.token) for c in content for t in c.top_logprobs)


def test_add_special_tokens_and_truncate_prompt_tokens(http, real_server, tok):
    plain = _complete(http, prompt="Hello, my name", max_tokens=1, add_special_tokens=False, **GREEDY)
    special = _complete(http, prompt="Hello, my name", max_tokens=1, **GREEDY)  # True by default
    assert special["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 1
    client = real_server.client()
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=1)
    chat_bos = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=1,
                                              extra_body={"add_special_tokens": True})
    assert chat_bos.usage.prompt_tokens == chat.usage.prompt_tokens + 1
    # truncate_prompt_tokens keeps the last N tokens: the same as sending them.
    ids = tok.encode(LONG_PROMPT, add_special_tokens=False)
    cut = _complete(http, prompt=ids, truncate_prompt_tokens=7, max_tokens=4, echo=True, **GREEDY)
    same = _complete(http, prompt=ids[-7:], max_tokens=4, echo=True, **GREEDY)
    assert cut["usage"]["prompt_tokens"] == 7
    assert cut["choices"][0]["text"] == same["choices"][0]["text"]
    assert cut["choices"][0]["text"].startswith(tok.decode(ids[-7:]))
    chat_cut = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=1,
                                              extra_body={"truncate_prompt_tokens": 2})
    assert chat_cut.usage.prompt_tokens == 2
    r = http.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": "Hi", "truncate_prompt_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_default_sampling_comes_from_the_generation_config(http):
    """The server runs with --override-generation-config '{"top_k": 1}': a request that sets no
    sampling field is greedy; one that sets top_k samples."""
    prompt = "The quick brown fox"
    greedy = _complete(http, prompt=prompt, max_tokens=12, temperature=0.0, ignore_eos=True)["choices"][0]["text"]
    defaulted = {_complete(http, prompt=prompt, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
                 for _ in range(2)}
    assert defaulted == {greedy}
    sampled = {_complete(http, prompt=prompt, max_tokens=12, top_k=-1, seed=s, ignore_eos=True)["choices"][0]["text"]
               for s in range(4)}
    assert sampled - {greedy}, "explicit top_k must override the model's default"


# ------------------------------------------------------------------ unsupported and unknown fields
_UNSUPPORTED = [
    ("guided_decoding_backend", "xgrammar"),
    ("functions", [{"name": "f"}]),
    ("function_call", {"name": "f"}),
    ("best_of", 3),
    ("logits_processors", ["x.Y"]),
    ("prompt_embeds", "AAAA"),
    ("cache_salt", "s"),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_unsupported_schema_fields_get_a_400_naming_them(http, endpoint):
    base = {"model": SERVED_MODEL, "max_tokens": 1}
    base.update({"prompt": "Hi"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    for name, value in _UNSUPPORTED:
        r = http.post(endpoint, json={**base, name: value})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"]
    # Their "off" values mean what leaving them out means.
    for name, value in [("response_format", {"type": "text"}), ("tools", []), ("best_of", 1),
                        ("use_beam_search", False), ("guided_json", None)]:
        assert http.post(endpoint, json={**base, name: value}).status_code == 200, name


def test_fields_in_neither_schema_are_ignored_with_a_warning(http, real_server):
    out = _complete(http, prompt="Hi", max_tokens=1, not_a_field_anywhere=3)
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert "not_a_field_anywhere" in real_server.log_tail()


def test_openai_client_sends_vllm_extras(real_server):
    """The official client with extra_body, as vLLM's docs show it."""
    client = real_server.client()
    out = client.completions.create(model=SERVED_MODEL, prompt="Hello", max_tokens=3, temperature=0.0,
                                    extra_body={"allowed_token_ids": [7], "ignore_eos": True})
    assert out.choices[0].text == "".join([AutoTokenizer.from_pretrained(real_server.model_path).decode([7])] * 3)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SERVED_MODEL, prompt="Hello", max_tokens=3,
                                  extra_body={"guided_decoding_backend": "xgrammar"})
    assert "guided_decoding_backend" in str(err.value)


def test_tokenizer_info_is_opt_in(fake_server_factory, real_server):
    assert httpx.get(fake_server_factory().base + "/tokenizer_info").status_code == 404
    info = httpx.get(real_server.base + "/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("</s>", "<s>", "<pad>")
    assert info["tokenizer_class"] and "{% for m in messages %}" in info["chat_template"]
    assert info["model_max_length"] == 256
