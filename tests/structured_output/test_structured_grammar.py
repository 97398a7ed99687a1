"""Grammar text per kind, and the JSON whitespace policy as the matcher enforces it."""

import json

import pytest

from jaxlm.structured_output.grammar import build_grammar, choice_to_lark, json_compile_options
from jaxlm.structured_output.params import StructuredOutputsParams as P

SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
          "required": ["a", "b"], "additionalProperties": False}
DOC = {"a": 1, "b": [2, 3]}


def _accepts(manager, params, text) -> bool:
    req = manager.new_request(params)
    return req.accept_tokens(manager.ll_tokenizer.tokenize_str(text)) and req.is_accepting()


def test_json_options_override_the_schema():
    schema = dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": True, "lenient": True}})
    grammar = json.loads(build_grammar(P(json=schema)))
    xg = grammar["grammars"][0]["json_schema"]["x-guidance"]
    # The whitespace policy wins over the schema's own options; its other options stay.
    assert xg == dict(json_compile_options("bounded"), lenient=True)
    assert json_compile_options("bounded") == {"whitespace_flexible": False, "item_separator": ", ",
                                               "key_separator": ": "}
    with pytest.raises(ValueError, match="unknown JSON whitespace mode"):
        json_compile_options("wide")


def test_bounded_whitespace_is_json_dumps(manager):
    bounded = P(json=SCHEMA)
    assert _accepts(manager, bounded, json.dumps(DOC))
    for other in (json.dumps(DOC, separators=(",", ":")), json.dumps(DOC, indent=2), " " + json.dumps(DOC),
                  json.dumps(DOC).replace(", ", ",  ")):
        assert not _accepts(manager, bounded, other), other


def test_disable_any_whitespace_is_compact(manager):
    none = P(json=SCHEMA, disable_any_whitespace=True)
    assert _accepts(manager, none, json.dumps(DOC, separators=(",", ":")))
    assert not _accepts(manager, none, json.dumps(DOC))


def test_flexible_whitespace_is_unbounded(manager):
    flexible = P(json=SCHEMA, whitespace="flexible")
    for text in (json.dumps(DOC), json.dumps(DOC, indent=2), json.dumps(DOC, separators=(",", ":"))):
        assert _accepts(manager, flexible, text)
    # What the bounded default prevents: any amount of whitespace before the first key.
    assert _accepts(manager, flexible, "{" + "\n" * 500 + json.dumps(DOC)[1:])
    assert not _accepts(manager, P(json=SCHEMA), "{\n" + json.dumps(DOC)[1:])


def test_choice_lark_escapes(manager):
    choices = ['say "hi"', "a|b", "back\\slash", "🙂", ""]
    assert choice_to_lark(["x", 'y"']) == 'start: "x" | "y\\""'
    for c in choices:
        assert _accepts(manager, P(choice=choices), c), c
    assert not _accepts(manager, P(choice=choices), "say hi")


def test_gbnf_grammar_is_accepted(manager):
    gbnf = 'root ::= "yes" | "no" digit\ndigit ::= [0-9]'
    assert _accepts(manager, P(grammar=gbnf), "no7")
    assert not _accepts(manager, P(grammar=gbnf), "yes7")


def test_regex_is_anchored(manager):
    assert _accepts(manager, P(regex="ab+"), "abbb")
    assert not _accepts(manager, P(regex="ab+"), "xabbb")
