"""Where the pieces of a (possibly still arriving) JSON tool call lie in the model's text.

The parsers report the model's own text for each call's arguments, so what streaming sends
(the arguments text as it grows) concatenates to exactly what a non-streaming response
carries. A value that has not ended yet reaches to the end of the text: everything after its
start belongs to it, so the text sent so far is always a prefix of the final arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index past the JSON string opening at text[i] == '"'; None if it has not closed yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index past the JSON value starting at text[i]; None if the text ends first."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # number, true, false, null: ends at a delimiter (at the text's end it may go on)
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


@dataclass
class CallSpan:
    """One tool call's JSON object in the text: its name (None until the name string has
    closed), where its arguments value starts and ends (None: not yet), and the object's span."""

    obj_start: int
    obj_end: int | None = None
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None

    def arguments(self, text: str) -> str | None:
        """The arguments text so far (a prefix of the final one while the value is open)."""
        if self.args_start is None:
            return None
        return text[self.args_start:len(text) if self.args_end is None else self.args_end]

    def is_valid(self, text: str) -> bool:
        """Complete, and a JSON object whose name is a string and arguments an object."""
        if self.obj_end is None or self.name is None or self.args_end is None:
            return False
        try:
            obj = json.loads(text[self.obj_start:self.obj_end])
            args = json.loads(text[self.args_start:self.args_end])
        except json.JSONDecodeError:
            return False
        return isinstance(obj, dict) and isinstance(args, dict)


def call_span(text: str, i: int, args_keys: tuple[str, ...]) -> CallSpan:
    """The call object opening at text[i] == '{': its "name" and the first of args_keys."""
    span = CallSpan(obj_start=i)
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        span.obj_end = j + 1
        return span
    while j < len(text) and text[j] == '"':
        key_end = string_end(text, j)
        if key_end is None:
            return span
        try:
            key = json.loads(text[j:key_end])
        except json.JSONDecodeError:
            return span
        j = skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            return span
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return span
        end = value_end(text, j)
        if key == "name" and span.name is None and text[j] == '"' and end is not None:
            try:
                span.name = json.loads(text[j:end])
            except json.JSONDecodeError:
                return span
        elif key in args_keys and span.args_start is None:
            span.args_start, span.args_end = j, end
        if end is None:
            return span
        j = skip_ws(text, end)
        if j < len(text) and text[j] == "}":
            span.obj_end = j + 1
            return span
        if j >= len(text) or text[j] != ",":
            return span
        j = skip_ws(text, j + 1)
    return span


def array_call_spans(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[list[CallSpan], bool]:
    """The call objects of the JSON array starting at or after text[i], and whether it closed."""
    j = skip_ws(text, i)
    if j >= len(text) or text[j] != "[":
        return [], False
    spans: list[CallSpan] = []
    j = skip_ws(text, j + 1)
    while j < len(text):
        if text[j] == "]":
            return spans, True
        if text[j] != "{":
            break
        span = call_span(text, j, args_keys)
        spans.append(span)
        if span.obj_end is None:
            break
        j = skip_ws(text, span.obj_end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
    return spans, False
