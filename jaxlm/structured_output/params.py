"""StructuredOutputsParams: one output constraint per request, with vLLM's field names.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
    StructuredOutputsParams(choice=["positive", "negative"])
    StructuredOutputsParams(grammar='start: "yes" | "no"')   # Lark (or GBNF) text
    StructuredOutputsParams(json_object=True)                 # any JSON object

Whitespace in JSON (``json`` and ``json_object`` only). Flexible JSON whitespace is the best-known
failure of constrained decoding: every engine (vLLM, SGLang, outlines, llguidance) has reports of
a model emitting newlines or spaces between JSON tokens until ``max_tokens``, returning broken
JSON. jaxlm therefore defaults to ``whitespace="bounded"``: between JSON tokens only the
separators ``json.dumps`` writes (``", "`` between items, ``": "`` after keys), nothing before
or after the value. With bounded whitespace a bounded schema (strings with ``maxLength``, arrays
with ``maxItems``, integers with a range, enums, ``additionalProperties: false``) admits finitely
many documents, so every model, even a random one, ends within a bounded number of tokens.
vLLM's ``disable_any_whitespace=True`` allows no whitespace at all (separators ``","`` and
``":"``); ``whitespace="flexible"`` is the opt-in for JSON's unbounded whitespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

WHITESPACE_POLICIES = ("bounded", "flexible")
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` (vLLM's names).

    ``json`` is a JSON schema (a dict or its JSON text); ``grammar`` is Lark (llguidance's dialect)
    or GBNF text. ``disable_any_whitespace`` and ``whitespace`` apply to ``json``/``json_object``.
    Bad input raises ``ValueError`` naming the field.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # jaxlm's JSON whitespace policy: "bounded" (json.dumps' separators only) or "flexible".
    whitespace: str = "bounded"
    # vLLM's whitespace_pattern: a regex for the whitespace between JSON tokens (replaces the
    # policy; "[ \n]*" brings back the unbounded case, at the caller's choice).
    whitespace_pattern: str | None = None
    # Reasoning models (set by the server's --reasoning-parser): the constraint starts after one
    # of these ids (e.g. </think>) is generated; before it, decoding is free (vLLM's behaviour).
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError(
                "structured_outputs needs exactly one constraint of json, regex, choice, grammar, "
                f"json_object; got {what}")
        self._check_constraint(given[0])
        if self.whitespace not in WHITESPACE_POLICIES:
            raise ValueError(f"structured_outputs.whitespace must be one of {WHITESPACE_POLICIES}, "
                             f"got {self.whitespace!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")
        if self.disable_any_whitespace and self.whitespace == "flexible":
            raise ValueError("structured_outputs: disable_any_whitespace contradicts whitespace='flexible'")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise ValueError("structured_outputs.whitespace_pattern must be a string (a regex)")
            if self.disable_any_whitespace or self.whitespace != "bounded":
                raise ValueError("structured_outputs: whitespace_pattern replaces disable_any_whitespace and "
                                 "whitespace; set only one")
        ends = self.reasoning_end_token_ids
        if ends is not None and (not isinstance(ends, (list, tuple)) or not ends
                                 or not all(isinstance(t, int) and t >= 0 for t in ends)):
            raise ValueError("structured_outputs.reasoning_end_token_ids must be a non-empty list of token ids")

    def _check_constraint(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object (a dict or its "
                                 f"JSON text), got {type(value).__name__}")
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be True or None, got {value!r}")
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) for c in value)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        elif not isinstance(value, str) or not value:  # regex, grammar
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def json_whitespace(self) -> str:
        """The effective JSON whitespace mode: "bounded", "none", "flexible", or "pattern"
        (whitespace_pattern)."""
        if self.whitespace_pattern is not None:
            return "pattern"
        return "none" if self.disable_any_whitespace else self.whitespace

    def spec_text(self) -> str:
        """The constraint as canonical text (JSON schemas re-serialized, key order kept)."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            # Key order is kept: llguidance emits properties in the schema's order.
            return json.dumps(schema, ensure_ascii=False)
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    def cache_key(self) -> tuple[str, str, str]:
        """(kind, text, JSON whitespace mode): equal keys compile to the same grammar."""
        kind = self.kind
        ws = self.json_whitespace if kind in ("json", "json_object") else ""
        if ws == "pattern":
            ws = f"pattern:{self.whitespace_pattern}"
        return kind, self.spec_text(), ws
