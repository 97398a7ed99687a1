"""StructuredOutputsParams -> an llguidance grammar (its TopLevelGrammar JSON text).

Building the text is cheap and needs no tokenizer; the expensive part (lexer and parser tables
against the vocabulary) happens when StructuredOutputManager makes an ``LLMatcher`` from it, which
is also where a bad grammar is reported. JSON whitespace follows the params' policy, passed as
llguidance's JSON compile options (``x-guidance``) *overriding* any the schema carries, so the
default bound holds for every schema:

  bounded   whitespace_flexible=False, item_separator=", ", key_separator=": "  (json.dumps)
  none      whitespace_flexible=False, item_separator=",",  key_separator=":"   (vLLM's
            disable_any_whitespace)
  flexible  whitespace_flexible=True: JSON's [ \\t\\n\\r]* around every token (opt-in)
  pattern   whitespace_pattern=<regex>: vLLM's whitespace_pattern, around every token
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from jaxlm.structured_output.params import StructuredOutputsParams

_JSON_WHITESPACE: dict[str, dict[str, Any]] = {
    "bounded": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "none": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "flexible": {"whitespace_flexible": True},
}
_ANY_JSON_OBJECT = '{"type": "object"}'


def json_compile_options(whitespace: str) -> dict[str, Any]:
    """llguidance's JSON compile options for a whitespace mode ("bounded", "none", "flexible")."""
    try:
        return dict(_JSON_WHITESPACE[whitespace])
    except KeyError:
        raise ValueError(f"unknown JSON whitespace mode {whitespace!r}; "
                         f"expected one of {sorted(_JSON_WHITESPACE)}") from None


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    if params.whitespace_pattern is not None:
        return {"whitespace_pattern": params.whitespace_pattern}
    return json_compile_options(params.json_whitespace)


def choice_to_lark(choices: list[str]) -> str:
    """A Lark grammar whose language is exactly the given strings."""
    # ensure_ascii=False: Lark string literals take JSON escapes, but not surrogate pairs.
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text for ``params`` (not yet checked against a tokenizer).

    Raises ValueError naming the constraint when the text cannot even be translated (for
    example GBNF that does not convert to Lark).
    """
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.spec_text() if kind == "json" else _ANY_JSON_OBJECT
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides=_json_options(params))
        except ValueError as e:
            raise ValueError(f"invalid {kind} constraint: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(choice_to_lark(list(params.choice)))
    # grammar: Lark text, or GBNF (llama.cpp / xgrammar style) converted to Lark.
    try:
        lark = any_to_lark(params.grammar)
    except Exception as e:  # the converter raises assorted types on malformed GBNF
        raise ValueError(f"invalid grammar constraint: cannot read it as Lark or GBNF: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)
