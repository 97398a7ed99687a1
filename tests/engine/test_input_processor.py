"""InputProcessor: the one admission path. Every field a request carries is checked (a ValueError
naming it) or resolved (stop ids, top_k, max_tokens) before the request reaches the engine."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from jaxlm.core.request import Request
from jaxlm.engine import input_processor as ip_mod
from jaxlm.engine.input_processor import InputProcessor, InvalidRequestError, PromptTooLongError
from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sampling_params import SamplingParams
from tests.helpers.tiny_tokenizer import TINY_VOCAB, add_tiny_tokenizer

EOS, SECOND_EOS = 2, 9
MAX_LEN = 64


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> InputProcessor:
    tok = AutoTokenizer.from_pretrained(add_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    checker = SamplingInputBuilder(TINY_VOCAB, MAX_LEN, max_logprobs=5)
    return InputProcessor(tok, MAX_LEN, TINY_VOCAB, EOS, {EOS, SECOND_EOS}, checker.check_params)


def _params(processor: InputProcessor, **kw) -> SamplingParams:
    return processor.process_params(SamplingParams(**kw), prompt_len=4)


# ---- stop ids: vLLM's meaning, resolved here only ------------------------------------------

def test_secondary_eos_ends_a_request_unless_ignore_eos(processor):
    p = _params(processor, stop_token_ids=[40])
    assert sorted(p.stop_token_ids) == [SECOND_EOS, 40]
    assert p.all_stop_token_ids == {EOS, SECOND_EOS, 40}
    q = _params(processor, stop_token_ids=[40], ignore_eos=True)
    assert q.stop_token_ids == [40]  # the generation-config eos no longer ends it...
    assert q.all_stop_token_ids == {EOS, SECOND_EOS, 40}  # ...but min_tokens still holds it back
    # The scheduler reads the resolved set from the Request; eos itself is checked apart.
    assert Request("r", [5, 6], p, eos_token_id=EOS).stop_token_ids == {SECOND_EOS, 40}
    assert Request("r", [5, 6], q, eos_token_id=EOS).stop_token_ids == {40}


def test_process_params_copies(processor):
    original = SamplingParams(stop_token_ids=[40], max_tokens=None)
    resolved = processor.process_params(original, prompt_len=10)
    assert original.stop_token_ids == [40] and original.max_tokens is None
    assert resolved.max_tokens == MAX_LEN - 10


# ---- strings: valid UTF-8 ------------------------------------------------------------------

@pytest.mark.parametrize("field,kw", [
    ("stop", dict(stop=["ok", "\ud800"])),
    ("bad_words", dict(bad_words=["\udfff"])),
])
def test_lone_surrogates_in_params_are_refused(processor, field, kw):
    with pytest.raises(InvalidRequestError, match=f"{field} is not valid UTF-8") as e:
        _params(processor, **kw)
    assert e.value.param == field


def test_lone_surrogates_in_prompt_and_request_id_are_refused(processor):
    with pytest.raises(InvalidRequestError, match="prompt is not valid UTF-8"):
        processor.process_prompt("abc\ud800")
    with pytest.raises(InvalidRequestError, match="prompt is not valid UTF-8"):
        processor.process_prompt({"prompt": "\ud800"})
    with pytest.raises(InvalidRequestError, match="request_id is not valid UTF-8"):
        processor.check_request_id("cmpl-\ud800")
    processor.check_request_id("cmpl-é-ok")


# ---- numbers: finite, within the sampler's arrays --------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", float("inf")), ("temperature", float("nan")),
    ("repetition_penalty", float("nan")), ("repetition_penalty", float("inf")),
    ("top_p", float("nan")), ("min_p", float("nan")),
    ("presence_penalty", float("nan")), ("frequency_penalty", float("-inf")),
])
def test_floats_must_be_finite(processor, field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        _params(processor, **{field: value})


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_floats_beyond_float32_are_refused(processor, field):
    with pytest.raises(InvalidRequestError, match=f"{field} must be at most"):
        _params(processor, **{field: 1e39})
    assert getattr(_params(processor, **{field: 1e38}), field) == 1e38


def test_logit_bias_values_finite_and_keys_in_vocab(processor):
    for value in (float("nan"), float("inf"), 1e39):
        with pytest.raises(InvalidRequestError, match="logit_bias values must be finite") as e:
            _params(processor, logit_bias={5: value})
        assert e.value.param == "logit_bias"
    with pytest.raises(ValueError, match="logit_bias contains out-of-vocab"):
        _params(processor, logit_bias={TINY_VOCAB: 1.0})
    assert _params(processor, logit_bias={5: -3.5}).logit_bias == {5: -3.5}


@pytest.mark.parametrize("top_k", [TINY_VOCAB, 2**31, 2**63, 2**64, 2**80])
def test_top_k_above_the_vocabulary_means_all_tokens(processor, top_k):
    assert _params(processor, temperature=1.0, top_k=top_k).top_k == 0  # never wraps in int32


def test_top_k_within_the_vocabulary_is_kept(processor):
    assert _params(processor, temperature=1.0, top_k=TINY_VOCAB - 1).top_k == TINY_VOCAB - 1


def test_seed_range(processor):
    for seed in (0, -1, -(2**63), 2**64 - 1):
        assert _params(processor, seed=seed).seed == seed
    for seed in (2**64, -(2**63) - 1, 2**100):
        with pytest.raises(InvalidRequestError, match="seed must fit in 64 bits"):
            _params(processor, seed=seed)


def test_huge_counts(processor):
    assert _params(processor, max_tokens=2**70).max_tokens == MAX_LEN - 4  # clamped to the room
    with pytest.raises(InvalidRequestError, match="n must be <= "):
        _params(processor, n=10**9)
    with pytest.raises(ValueError, match="logprobs=1000000000000 exceeds max_logprobs=5"):
        _params(processor, logprobs=10**12)
    with pytest.raises(ValueError, match="prompt_logprobs=99 exceeds max_logprobs=5"):
        _params(processor, prompt_logprobs=99)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        _params(processor, max_tokens=3, min_tokens=2**64)


# ---- caps on what costs CPU per step -----------------------------------------------------------

def test_caps_on_stop_strings_stop_ids_and_bad_words(processor):
    many = [f"s{i}" for i in range(ip_mod.MAX_STOP_STRINGS + 1)]
    with pytest.raises(InvalidRequestError, match="stop strings are supported"):
        _params(processor, stop=many)
    assert len(_params(processor, stop=many[:-1]).stop) == ip_mod.MAX_STOP_STRINGS
    with pytest.raises(InvalidRequestError, match="stop strings hold"):
        _params(processor, stop=["x" * (ip_mod.MAX_STOP_STRINGS_TOTAL_CHARS + 1)])
    with pytest.raises(InvalidRequestError, match="stop_token_ids are supported"):
        _params(processor, stop_token_ids=[5] * (ip_mod.MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(InvalidRequestError, match="bad_words are supported"):
        _params(processor, bad_words=["w"] * (ip_mod.MAX_BAD_WORDS + 1))


# ---- prompts ------------------------------------------------------------------------------------

def test_prompt_checks(processor):
    assert processor.process_prompt({"prompt_token_ids": [5, 6]}).prompt_token_ids == [5, 6]
    with pytest.raises(InvalidRequestError, match="cannot be empty"):
        processor.process_prompt([])
    with pytest.raises(InvalidRequestError, match=f"Token id {TINY_VOCAB} is out of vocabulary"):
        processor.process_prompt([5, TINY_VOCAB])
    with pytest.raises(PromptTooLongError, match=f"maximum model length of {MAX_LEN}") as e:
        processor.process_prompt([5] * MAX_LEN)
    assert (e.value.prompt_len, e.value.max_model_len) == (MAX_LEN, MAX_LEN)
    with pytest.raises(InvalidRequestError, match="a list of token ids"):
        processor.process_prompt([5, True])
    with pytest.raises(InvalidRequestError, match="'prompt' or a 'prompt_token_ids' key"):
        processor.process_prompt({"text": "x"})
