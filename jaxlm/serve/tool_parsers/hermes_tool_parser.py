"""Hermes (NousResearch, Qwen2.5/Qwen3): each call is ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``; text before the first call is the content, text after is dropped."""

from __future__ import annotations

from typing import Any

from jaxlm.reasoning.basic_parsers import held_back
from jaxlm.serve.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from jaxlm.serve.tool_parsers.json_spans import CallSpan, call_span


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"

    def adjust_request(self, request: Any) -> Any:
        # The markers may be special tokens: keep them in the text the parser reads.
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def locate(self, text: str, final: bool) -> tuple[str, list[CallSpan]]:
        first = text.find(self.tool_call_start_token)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, self.tool_call_start_token)
            return text[:keep], []
        spans = []
        at = first
        while at >= 0:
            brace = text.find("{", at + len(self.tool_call_start_token))
            if brace < 0:
                break
            span = call_span(text, brace, ("arguments",))
            spans.append(span)
            if span.obj_end is None:
                break
            at = text.find(self.tool_call_start_token, span.obj_end)
        return text[:first], spans
