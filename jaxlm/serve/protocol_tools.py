"""OpenAI's schemas for tool calling and response formats (vLLM's class names).

Leaf module (pydantic only): protocol.py and the tool parsers both import it.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def make_tool_call_id() -> str:
    """vLLM's tool-call id: "chatcmpl-tool-" and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(_Model):
    name: str


class ChatCompletionNamedToolChoiceParam(_Model):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Model):
    """One streamed fragment of a tool call: the first carries id, type and name; later ones
    carry arguments text to append (the same index)."""

    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class JsonSchemaResponseFormat(_Model):
    name: str = "response"
    description: str | None = None
    # "schema" shadows BaseModel.schema: stored as json_schema, read and written as "schema".
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None
