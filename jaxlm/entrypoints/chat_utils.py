"""Chat messages as chat templates read them (vLLM's chat_utils): used by the server's chat
completions and /tokenize, and by LLM.chat.

Leaf module (no jax, no pydantic): messages come as dicts (LLM.chat) or as the server's
pydantic ChatMessage (its extra fields, e.g. tool_calls, in model_extra)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jaxlm.engine.input_processor import InvalidRequestError


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as text: OpenAI's text parts joined by newlines (as vLLM)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError("messages", f"unsupported content part type {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _fields(message: Any) -> Mapping[str, Any]:
    if isinstance(message, Mapping):
        return message
    # A pydantic ChatMessage: its declared fields and the extras a client sent (tool_calls, ...).
    return {"role": message.role, "content": message.content, **(message.model_extra or {})}


def message_dict(message: Any) -> dict[str, Any]:
    """A message as chat templates read it: content as text, tool calls' arguments as objects
    (what HF templates expect, as vLLM passes them), and the tool message's tool_call_id."""
    fields = _fields(message)
    out: dict[str, Any] = {"role": fields.get("role"), "content": content_text(fields.get("content"))}
    if fields.get("tool_calls"):
        calls = []
        for call in fields["tool_calls"]:
            call = dict(call)
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # the template gets the text
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    if fields.get("tool_call_id") is not None:
        out["tool_call_id"] = fields["tool_call_id"]
    return out


def parse_chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation a chat template renders."""
    return [message_dict(m) for m in messages]
