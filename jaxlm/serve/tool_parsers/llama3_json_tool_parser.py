"""Llama 3.x JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}``
(optionally after ``<|python_tag|>``), several separated by ``;``. An output that does not open
with a call is plain content."""

from __future__ import annotations

from jaxlm.serve.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from jaxlm.serve.tool_parsers.json_spans import CallSpan, call_span, skip_ws


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"

    def locate(self, text: str, final: bool) -> tuple[str, list[CallSpan]]:
        start = skip_ws(text, 0)
        if text.startswith(self.bot_token, start):
            start = skip_ws(text, start + len(self.bot_token))
        elif not final and self.bot_token.startswith(text[start:]):
            return "", []  # may be the python tag arriving
        if start >= len(text):
            return ("" if not final else text), []
        if text[start] != "{":
            return text, []
        spans = []
        while start < len(text) and text[start] == "{":
            span = call_span(text, start, ("parameters", "arguments"))
            spans.append(span)
            if span.obj_end is None:
                break
            start = skip_ws(text, span.obj_end)
            if start < len(text) and text[start] == ";":
                start = skip_ws(text, start + 1)
        return "", spans
