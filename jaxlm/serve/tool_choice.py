"""tool_choice on /v1/chat/completions (vLLM's behaviour):

  "none"        tools reach the chat template only; no constraint, no parsing.
  "auto"        the model may call tools: --tool-call-parser's parser reads them from its text
                (needs --enable-auto-tool-choice, else 400).
  "required"    the output is constrained to a JSON array of {"name", "parameters"} objects,
                each one tool's schema; finish_reason "tool_calls".
  named         the output is constrained to that function's parameters schema: one call,
                finish_reason as the engine reports it ("stop"), as vLLM.
"""

from __future__ import annotations

from typing import Any

from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol_tools import ChatCompletionNamedToolChoiceParam, ChatCompletionToolsParam
from jaxlm.serve.tool_parsers.abstract_tool_parser import ToolParser
from jaxlm.serve.tool_parsers.json_spans import CallSpan, array_call_spans

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def effective_tool_choice(request: Any) -> str | ChatCompletionNamedToolChoiceParam:
    """The request's tool_choice with OpenAI's default: "auto" with tools, else "none"."""
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def _parameters(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def tool_choice_constraint(request: Any) -> tuple[str, dict[str, Any]] | None:
    """("tool_choice", StructuredOutputsParams fields) for "required" or a named function."""
    choice = effective_tool_choice(request)
    if choice in ("none", "auto"):
        return None
    tools = request.tools or []
    if not tools:
        raise OpenAIError(f"tool_choice {choice if isinstance(choice, str) else 'function'} needs tools",
                          400, "tool_choice")
    if choice == "required":
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if request.parallel_tool_calls is False:
            array["maxItems"] = 1
        return "tool_choice", {"json": array}
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise OpenAIError(f"tool_choice names function {name!r}, which is not in tools", 400, "tool_choice")
    return "tool_choice", {"json": _parameters(tool)}


class NamedToolParser(ToolParser):
    """The whole output is the named function's arguments."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        super().__init__(tokenizer)
        self.name = name

    def locate(self, text: str, final: bool) -> tuple[str, list[CallSpan]]:
        end = len(text) if final else None
        return "", [CallSpan(obj_start=0, obj_end=end, name=self.name, args_start=0, args_end=end)]


class RequiredToolParser(ToolParser):
    """The output is a JSON array of {"name": ..., "parameters": {...}} calls."""

    def locate(self, text: str, final: bool) -> tuple[str, list[CallSpan]]:
        spans, _ = array_call_spans(text, 0, ("parameters",))
        return "", spans


def forced_tool_parser(request: Any, tokenizer: Any) -> ToolParser | None:
    """The parser of a "required" or named tool_choice's constrained output; None otherwise."""
    choice = effective_tool_choice(request)
    if choice == "required":
        return RequiredToolParser(tokenizer)
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return NamedToolParser(tokenizer, choice.function.name)
    return None
