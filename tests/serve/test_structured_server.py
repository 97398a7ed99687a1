"""Structured outputs and tool calling through the server, on a tiny random model (which writes
garbage unconstrained: a valid output is the constraint's doing), with the official client."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import ServerThread, serve_engine

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY_SCHEMA = {"type": "object",
               "properties": {"city": {"type": "string", "maxLength": 8},
                              "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": CITY_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# Forces a hermes-formatted call, so "auto" + the hermes parser has calls to find.
HERMES_REGEX = (r'<tool_call>\{"name": "(get_weather|get_time)", "arguments": \{"city": "[a-z]{1,6}"\}\}'
                r"</tool_call>")


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = serve_engine(tiny_llama, ["--served-model-name", MODEL, "--enable-auto-tool-choice",
                                    "--tool-call-parser", "hermes"],
                       max_model_len=256, max_num_seqs=4, num_gpu_blocks_override=96, seq_buckets=[4])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _chat(client, **kw):
    kw.setdefault("max_tokens", 96)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, **kw)


def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY_SCHEMA, "strict": True}}
    for seed in range(2):
        out = _chat(client, response_format=fmt, n=3, seed=seed)
        for choice in out.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)
    out = _chat(client, response_format={"type": "json_object"}, seed=0, max_tokens=128,
                extra_body={"structured_outputs": None})
    assert out.choices[0].finish_reason != "stop" or isinstance(json.loads(out.choices[0].message.content), dict)


class Weather(BaseModel):
    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Weather,
                                        temperature=1.0, seed=3, max_tokens=96)
    assert isinstance(out.choices[0].message.parsed, Weather)


@pytest.mark.parametrize("extra, valid", [
    ({"guided_regex": "[a-c]{2,5}"}, lambda t: 2 <= len(t) <= 5 and set(t) <= set("abc")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_json": CITY_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), CITY_SCHEMA) is None),
    ({"guided_grammar": 'start: "x" | "y" "z"'}, lambda t: t in ("x", "yz")),
    ({"guided_json": CITY_SCHEMA, "guided_whitespace_pattern": "[ ]?"},
     lambda t: jsonschema.validate(json.loads(t), CITY_SCHEMA) is None and "  " not in t),
])
def test_vllm_fields_on_completions_and_chat(client, extra, valid):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=64, temperature=1.0, seed=1,
                                    n=2, extra_body=extra)
    assert all(c.finish_reason == "stop" and valid(c.text) for c in out.choices), [c.text for c in out.choices]
    chat = _chat(client, seed=2, extra_body=extra)
    assert valid(chat.choices[0].message.content), chat.choices[0].message.content


def test_tool_choice_named(client):
    for seed in range(3):
        out = _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    seed=seed)
        choice = out.choices[0]
        [call] = choice.message.tool_calls
        assert call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)
        assert choice.finish_reason == "stop"  # vLLM's finish_reason for a named function


def _reassemble(stream) -> tuple[str, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            if tc.id is not None:
                assert tc.id.startswith("chatcmpl-tool-") and tc.function.name and entry["name"] is None
                entry["name"] = tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


def test_tool_choice_required_whole_and_streamed(client):
    for seed in range(3):
        kw = dict(tools=TOOLS, tool_choice="required", seed=seed, max_tokens=160)
        out = _chat(client, **kw)
        choice = out.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls and choice.finish_reason == "tool_calls", choice
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        content, streamed, finish = _reassemble(_chat(client, stream=True, **kw))
        assert (streamed, finish) == (calls, "tool_calls") and not content


def test_auto_tool_choice_with_hermes_whole_and_streamed(client):
    kw = dict(tools=TOOLS, seed=5, extra_body={"guided_regex": HERMES_REGEX})
    out = _chat(client, **kw)
    choice = out.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(calls) == 1 and choice.finish_reason == "tool_calls" and not choice.message.content
    assert json.loads(calls[0][1])["city"].isalpha()
    _, streamed, finish = _reassemble(_chat(client, stream=True, **kw))
    assert (streamed, finish) == (calls, "tool_calls")
    # tool_choice "none": the same text stays content.
    out = _chat(client, tool_choice="none", **kw)
    assert out.choices[0].message.content.startswith("<tool_call>") and not out.choices[0].message.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "structured_outputs"),
    ({"guided_regex": "(unclosed"}, "structured_outputs"),
    ({"guided_grammar": "start: undefined_rule"}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_bad_constraints_get_a_400_and_the_server_stays_healthy(server, body, param):
    with httpx.Client(base_url=server.base, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                                "guided_choice": ["fine"]})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"


def test_auto_tool_choice_needs_the_server_flags(fake_server_factory):
    client = fake_server_factory().client()
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS)
    # tool_choice "none" passes the tools to the template only.
    out = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                         tools=TOOLS, tool_choice="none", max_tokens=4)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_reasoning_parser_splits_whole_and_streamed(server):
    # A second front end over the same engine, with --reasoning-parser. The tiny tokenizer has
    # no </think> token, so the constraint (here forcing a reasoning-shaped text) applies from
    # the first token; tests/structured_output covers the engine waiting for the end token.
    srv = ServerThread(server.engine, ["--served-model-name", MODEL, "--reasoning-parser", "deepseek_r1"])
    try:
        client = srv.client()
        kw = dict(seed=4, extra_body={"guided_regex": r'[a-z]{1,6}</think>\{"a": [0-9]\}'})
        msg = _chat(client, **kw).choices[0].message
        assert msg.reasoning_content.isalpha() and json.loads(msg.content)["a"] in range(10)
        reasoning, content = "", ""
        for chunk in _chat(client, stream=True, **kw):
            if chunk.choices:
                reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                content += chunk.choices[0].delta.content or ""
        assert (reasoning, content) == (msg.reasoning_content, msg.content)
    finally:
        srv.stop()


def test_required_with_parallel_tool_calls_false_makes_one_call(client):
    out = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=1, max_tokens=160)
    [call] = out.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
