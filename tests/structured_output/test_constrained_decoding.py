"""Constrained decoding with a random "model" (temperature 1, 32 seeds): every output is valid.

Random logits are the worst case for constrained decoding: nothing steers the model towards
closing a string or a bracket, so these tests show the constraint alone makes outputs valid and,
for a bounded schema with the default bounded whitespace, ends them within a bounded length.
"""

import json
import re

import jsonschema
import pytest

from jaxlm.structured_output.params import StructuredOutputsParams
from tests.structured_output.so_helpers import (
    ARITH_LARK, BOUNDED_SCHEMA, BOUNDED_SCHEMA_MAX_TOKENS, CHOICES, NUM_SEEDS, REGEX, is_arith, simulate)

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _skeleton(text: str) -> str:
    """JSON text with every string literal replaced by "" (escapes may be spelled many ways)."""
    return _JSON_STRING.sub('""', text)


def test_bounded_json_schema_always_valid_and_terminates(manager):
    # max_tokens is the bound itself: a row still running there would come back as None.
    res = simulate(manager, StructuredOutputsParams(json=BOUNDED_SCHEMA), max_tokens=BOUNDED_SCHEMA_MAX_TOKENS,
                   replay_at=7)
    assert None not in res.texts, "a bounded schema did not finish within its bound"
    for text in res.texts:
        doc = json.loads(text)
        jsonschema.validate(doc, BOUNDED_SCHEMA)
        # Bounded whitespace: outside strings, byte for byte what json.dumps writes.
        assert _skeleton(text) == _skeleton(json.dumps(doc)), text
    # The outputs differ (the seeds matter) and use the optional fields sometimes.
    assert len(set(res.texts)) == NUM_SEEDS
    assert any("tags" in json.loads(t) for t in res.texts)


@pytest.mark.parametrize("mode", ["none", "flexible"])
def test_json_whitespace_modes_valid(manager, mode):
    params = StructuredOutputsParams(json=BOUNDED_SCHEMA, disable_any_whitespace=mode == "none",
                                     whitespace="flexible" if mode == "flexible" else "bounded")
    res = simulate(manager, params, max_tokens=400, num_seeds=8)
    finished = [t for t in res.texts if t is not None]
    assert len(finished) >= 4
    for text in finished:
        jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
        if mode == "none":
            assert _skeleton(text) == _skeleton(json.dumps(json.loads(text), separators=(",", ":")))
    if mode == "flexible":  # what the bounded default rules out: whitespace wherever JSON allows it
        assert all(_skeleton(t) != _skeleton(json.dumps(json.loads(t))) for t in finished)


def test_json_whitespace_pattern(manager):
    params = StructuredOutputsParams(json=BOUNDED_SCHEMA, whitespace_pattern="[ ]?")
    finished = [t for t in simulate(manager, params, max_tokens=400, num_seeds=8).texts if t is not None]
    assert len(finished) >= 4
    for text in finished:
        jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
        assert "  " not in _skeleton(text) and "\n" not in text
    # Single spaces are allowed where bounded whitespace has none (around braces, before ':').
    assert any(_skeleton(t) != _skeleton(json.dumps(json.loads(t))) for t in finished)


def test_json_object_is_an_object(manager):
    res = simulate(manager, StructuredOutputsParams(json_object=True), max_tokens=200, num_seeds=16)
    finished = [t for t in res.texts if t is not None]
    assert finished, "no json_object output finished in 200 tokens"
    for text in finished:
        assert isinstance(json.loads(text), dict)


def test_regex_outputs_fullmatch(manager):
    res = simulate(manager, StructuredOutputsParams(regex=REGEX), max_tokens=64, replay_at=4)
    assert None not in res.texts
    for text in res.texts:
        assert re.fullmatch(REGEX, text), text
    # Both ends: the optional suffix taken by some rows, EOS right after the digits by others.
    assert any("." in t for t in res.texts) and any("." not in t for t in res.texts)


def test_choice_outputs_are_choices(manager):
    res = simulate(manager, StructuredOutputsParams(choice=CHOICES), max_tokens=32, replay_at=1)
    assert None not in res.texts
    assert set(res.texts) <= set(CHOICES)
    assert len(set(res.texts)) >= 3  # 'yes' vs 'yes please' needs EOS vs continue: both happen
    assert "yes" in res.texts or "yes please" in res.texts


def test_lark_arithmetic_outputs_parse(manager):
    res = simulate(manager, StructuredOutputsParams(grammar=ARITH_LARK), max_tokens=160, replay_at=10)
    finished = [t for t in res.texts if t is not None]
    assert len(finished) >= NUM_SEEDS // 2, f"only {len(finished)} of {NUM_SEEDS} finished"
    for text in finished:
        assert is_arith(text), text
    assert any("(" in t for t in finished)  # the recursion is exercised
    # The checker itself rejects near misses.
    assert not is_arith("1+") and not is_arith("(1") and not is_arith("1 + 2") and not is_arith("1234")
