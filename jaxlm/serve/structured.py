"""A request's output constraint: OpenAI's response_format, vLLM's structured_outputs and its
older guided_* fields, and (chat) the constraint a tool_choice implies, as one
StructuredOutputsParams. At most one source per request: two are a 400 naming both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlm.serve.errors import OpenAIError
from jaxlm.structured_output.params import StructuredOutputsParams

# vLLM's guided_* field -> the StructuredOutputsParams field it sets.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
# What a request's structured_outputs object may set (the engine-side fields are the server's).
_REQUEST_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "whitespace",
                   "whitespace_pattern")


def _response_format_fields(request: Any) -> dict[str, Any] | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise OpenAIError("response_format json_schema needs json_schema.schema", 400, "response_format")
    return {"json": fmt.json_schema.json_schema}


def _structured_outputs_fields(request: Any) -> dict[str, Any] | None:
    so = request.structured_outputs
    if not so:
        return None
    unknown = sorted(set(so) - set(_REQUEST_FIELDS))
    if unknown:
        raise OpenAIError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                          f"{', '.join(_REQUEST_FIELDS)})", 400, "structured_outputs")
    return dict(so)


def constraint_sources(request: Any) -> dict[str, dict[str, Any]]:
    """Each request field that sets a constraint -> the StructuredOutputsParams fields it means."""
    sources: dict[str, dict[str, Any]] = {}
    for name, fields in (("response_format", _response_format_fields(request)),
                         ("structured_outputs", _structured_outputs_fields(request))):
        if fields is not None:
            sources[name] = fields
    for name, field in _GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            sources[name] = {field: value}
    return sources


def structured_outputs_for(request: Any, implied: tuple[str, dict[str, Any]] | None = None
                           ) -> StructuredOutputsParams | None:
    """The request's one constraint, or None. implied: (field, StructuredOutputsParams fields) a
    tool_choice adds. Bad or clashing constraints raise OpenAIError(400) naming the field; a
    constraint that fails to compile is reported by the engine at admission (also a 400)."""
    sources = constraint_sources(request)
    if implied is not None:
        sources[implied[0]] = implied[1]
    if len(sources) > 1:
        names = sorted(sources)
        raise OpenAIError(f"only one output constraint per request; got {', '.join(names)}", 400, names[0])
    pattern = request.guided_whitespace_pattern
    if not sources:
        if pattern is not None:
            raise OpenAIError("guided_whitespace_pattern needs a JSON constraint", 400, "guided_whitespace_pattern")
        return None
    (name, fields), = sources.items()
    if pattern is not None:
        fields = {**fields, "whitespace_pattern": pattern}
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise OpenAIError(f"{name}: {e}", 400, name) from None


def with_reasoning_end(params: StructuredOutputsParams, end_token_ids: list[int]) -> StructuredOutputsParams:
    """params enforced only after one of end_token_ids (the reasoning's end) is generated."""
    return dataclasses.replace(params, reasoning_end_token_ids=list(end_token_ids))
