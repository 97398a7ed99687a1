"""StructuredOutputsParams: validation (one constraint, clear errors), kind, cache key, import cost."""

import subprocess
import sys

import pytest

from jaxlm.structured_output.params import StructuredOutputsParams as P


@pytest.mark.parametrize("kwargs, kind", [
    (dict(json={"type": "object"}), "json"),
    (dict(json='{"type": "string"}'), "json"),
    (dict(regex="a+"), "regex"),
    (dict(choice=["a", "b"]), "choice"),
    (dict(grammar='start: "x"'), "grammar"),
    (dict(json_object=True), "json_object"),
    (dict(regex="a+", json_object=False), "regex"),  # False means unset, as in vLLM
])
def test_kind(kwargs, kind):
    assert P(**kwargs).kind == kind


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one constraint.*got none"),
    (dict(json={"type": "object"}, regex="a"), "exactly one constraint.*got json, regex"),
    (dict(choice=["a"], grammar="start: x", json_object=True), "got choice, grammar, json_object"),
    (dict(json="{not json"), "json is not valid JSON"),
    (dict(json="[1, 2]"), "json must be a JSON schema object.*list"),
    (dict(json=42), "json must be a JSON schema object.*int"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(regex=3), "regex must be a non-empty string"),
    (dict(grammar=""), "grammar must be a non-empty string"),
    (dict(choice=[]), "choice must be a non-empty list of strings"),
    (dict(choice="ab"), "choice must be a non-empty list of strings"),
    (dict(choice=["a", 1]), "choice must be a non-empty list of strings"),
    (dict(json_object="yes"), "json_object must be True"),
    (dict(json_object=True, whitespace="wide"), "whitespace must be one of"),
    (dict(json_object=True, disable_any_whitespace=1), "disable_any_whitespace must be a bool"),
    (dict(json_object=True, disable_any_whitespace=True, whitespace="flexible"), "contradicts"),
])
def test_bad_params_raise_naming_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        P(**kwargs)


def test_whitespace_mode_default_bounded():
    assert P(json_object=True).json_whitespace == "bounded"
    assert P(json_object=True, disable_any_whitespace=True).json_whitespace == "none"
    assert P(json_object=True, whitespace="flexible").json_whitespace == "flexible"
    assert P(json_object=True, whitespace_pattern="[ ]?").json_whitespace == "pattern"
    assert P(json_object=True, whitespace_pattern="[ ]?").cache_key() != P(json_object=True).cache_key()
    with pytest.raises(ValueError, match="whitespace_pattern replaces"):
        P(json_object=True, whitespace_pattern=" ", disable_any_whitespace=True)
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        P(json_object=True, reasoning_end_token_ids=[])


def test_cache_key():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    as_dict, as_text = P(json=schema), P(json='{ "type":"object", "properties": {"b": {"type":"string"},'
                                                  ' "a": {"type": "integer"}}}')
    assert as_dict.cache_key() == as_text.cache_key()
    assert as_dict.cache_key() != P(json=schema, disable_any_whitespace=True).cache_key()
    # Property order is meaningful (outputs follow it), so it is not normalized away.
    reordered = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    assert P(json=reordered).cache_key() != as_dict.cache_key()
    # Whitespace settings do not split the cache for non-JSON kinds.
    assert P(regex="a+").cache_key() == P(regex="a+", disable_any_whitespace=True).cache_key()
    assert P(regex="a+").cache_key() != P(grammar="a+").cache_key()
    assert P(choice=["a", "b"]).cache_key() == ("choice", '["a", "b"]', "")


def test_params_module_is_light():
    # SamplingParams imports it and the scheduler imports SamplingParams: no jax, no llguidance.
    code = ("import sys, jaxlm.structured_output.params; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('jax', 'llguidance', 'numpy')]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
