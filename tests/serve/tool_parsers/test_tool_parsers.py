"""Tool parsers on text: whole outputs, streamed deltas (every split point), partial JSON,
several calls, malformed calls -> plain content."""

from __future__ import annotations

import json

import pytest

from jaxlm.serve.protocol_chat import ChatCompletionRequest
from jaxlm.serve.tool_choice import NamedToolParser, RequiredToolParser
from jaxlm.serve.tool_parsers import Hermes2ProToolParser, Llama3JsonToolParser, ToolParserManager
from jaxlm.serve.tool_parsers.json_spans import array_call_spans, call_span, value_end

REQUEST = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
HERMES_TWO = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET \\"x\\" }"}}\n</tool_call>')
LLAMA_TWO = '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "noop", "parameters": {}}'


def stream(parser, text: str, chunk_sizes):
    """Feed text in chunks; returns (content, [(id, name, arguments)], deltas)."""
    content, calls, deltas, pos, i = "", {}, [], 0, 0
    previous = ""
    while pos < len(text):
        size = chunk_sizes[i % len(chunk_sizes)]
        i += 1
        piece = text[pos:pos + size]
        pos += size
        current = previous + piece
        delta = parser.extract_tool_calls_streaming(previous, current, piece, REQUEST)
        previous = current
        if delta is None:
            continue
        deltas.append(delta)
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert entry["id"] is None and tc.type == "function" and tc.function.name
                entry["id"], entry["name"] = tc.id, tc.function.name
            else:
                assert entry["id"] is not None, "arguments before the call's id and name"
            entry["arguments"] += tc.function.arguments or ""
    return content, [calls[k] for k in sorted(calls)], deltas


@pytest.mark.parametrize("parser_cls,text,expected", [
    (Hermes2ProToolParser, HERMES_TWO,
     [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": 'CET "x" }'})]),
    (Llama3JsonToolParser, LLAMA_TWO, [("get_weather", {"city": "Rome"}), ("noop", {})]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "f", "arguments": {"a": [1, {"b": null}]}}',
     [("f", {"a": [1, {"b": None}]})]),
])
@pytest.mark.parametrize("chunks", [[1], [3, 1, 7], [1000]])
def test_calls_parse_whole_and_streamed_alike(parser_cls, text, expected, chunks):
    info = parser_cls(None).extract_tool_calls(text, REQUEST)
    assert info.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == expected
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in info.tool_calls)
    content, calls, _ = stream(parser_cls(None), text, chunks)
    assert content == (info.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in info.tool_calls]


def test_hermes_content_before_the_call_and_no_partial_marker_leaks():
    text = 'Sure <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    info = Hermes2ProToolParser(None).extract_tool_calls(text, REQUEST)
    assert info.content == "Sure " and info.tool_calls[0].function.arguments == "{}"
    _, _, deltas = stream(Hermes2ProToolParser(None), text, [1])
    assert not any("<" in (d.content or "") for d in deltas)


def test_name_first_then_argument_fragments():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    _, calls, deltas = stream(Hermes2ProToolParser(None), text, [2])
    tool_deltas = [tc for d in deltas for tc in d.tool_calls or []]
    assert tool_deltas[0].id and tool_deltas[0].function.name == "get_weather"
    assert len(tool_deltas) > 3 and all(tc.id is None and tc.function.name is None for tc in tool_deltas[1:])
    assert calls[0]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("parser_cls,text", [
    (Hermes2ProToolParser, "no tools here, just <b>text</b>"),
    (Hermes2ProToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'),  # broken JSON
    (Hermes2ProToolParser, '<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>'),
    (Llama3JsonToolParser, "The answer is 4."),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"a": 1}'),  # cut off
    (Llama3JsonToolParser, '{"arguments": {}}'),  # no name
])
def test_malformed_or_absent_calls_are_plain_content(parser_cls, text):
    info = parser_cls(None).extract_tool_calls(text, REQUEST)
    assert not info.tools_called and info.tool_calls == [] and info.content == text


def test_plain_text_streams_as_content():
    text = "The answer is <4> and {5}."
    for cls in (Hermes2ProToolParser, Llama3JsonToolParser):
        content, calls, _ = stream(cls(None), text, [1, 2])
        assert calls == [] and content == text


def test_forced_parsers():
    named = NamedToolParser(None, "get_weather").extract_tool_calls('{"city": "Oslo"}', REQUEST)
    assert [(c.function.name, c.function.arguments) for c in named.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    required = RequiredToolParser(None).extract_tool_calls(text, REQUEST)
    assert [(c.function.name, c.function.arguments) for c in required.tool_calls] == [("a", '{"x": 1}'), ("b", "{}")]
    for chunks in ([1], [5, 2]):
        _, calls, _ = stream(RequiredToolParser(None), text, chunks)
        assert [(c["name"], c["arguments"]) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
        _, calls, _ = stream(NamedToolParser(None, "g"), '{"city": "Oslo"}', chunks)
        assert [(c["name"], c["arguments"]) for c in calls] == [("g", '{"city": "Oslo"}')]


def test_json_spans_on_partial_text():
    assert value_end('{"a": "}"}', 0) == 10 and value_end('{"a": "}', 0) is None
    assert value_end("123", 0) is None and value_end("123,", 0) == 3
    span = call_span('{"name": "f", "arguments": {"a": [1, 2', 0, ("arguments",))
    assert span.name == "f" and span.args_end is None and span.arguments('{"name": "f", "arguments": {"a": [1, 2') \
        == '{"a": [1, 2'
    assert call_span('{"name": "f', 0, ("arguments",)).name is None
    spans, closed = array_call_spans('[{"name": "a", "parameters": {}}, {"na', 0, ("parameters",))
    assert [s.name for s in spans] == ["a", None] and not closed


def test_registry_names_the_known_parsers():
    assert set(ToolParserManager.tool_parsers) >= {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="hermes"):
        ToolParserManager.get_tool_parser("nope")
