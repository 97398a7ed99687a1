"""IncrementalDetokenizer: exact text for multi-byte output, stop strings, streaming deltas."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest  # noqa: E402

from jaxlm.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from jaxlm.sampling_params import SamplingParams  # noqa: E402
from tests.sample.tok_helpers import byte_fallback_tokenizer, smollm2_tokenizer  # noqa: E402

TEXTS = [
    "Hello 🙂 世界! naïve café — 日本語のテキスト 👩‍👩‍👧 done.",
    "emoji at the end 🎉",
    "中文",
]


@pytest.fixture(scope="module", params=["smollm2", "byte_fallback"])
def tok(request):
    return smollm2_tokenizer() if request.param == "smollm2" else byte_fallback_tokenizer()


def _stream(tok, prompt, out_ids, params, chunk=1):
    """Feed tokens `chunk` at a time; return (deltas, stop_str, tokens consumed, detok)."""
    det = IncrementalDetokenizer(tok, prompt, params)
    deltas, stop, used = [], None, 0
    for i in range(0, len(out_ids), chunk):
        new = out_ids[i:i + chunk]
        used += len(new)
        stop = det.update(new)
        finished = stop is not None or used == len(out_ids)
        deltas.append(det.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return deltas, stop, used, det


def _expected(tok, prompt, out_ids, skip=True):
    # With the prompt as context (as vLLM): the output's share of the full decode.
    full = tok.decode(prompt + out_ids, skip_special_tokens=skip)
    head = tok.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head):]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_streaming_is_exact(tok, text, chunk):
    prompt = tok.encode("Say:", add_special_tokens=False)
    out = tok.encode(" " + text, add_special_tokens=False)
    deltas, stop, _, det = _stream(tok, prompt, out, SamplingParams(), chunk)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == det.output_text == _expected(tok, prompt, out)
    assert det.get_next_output_text(finished=True, delta=False) == det.output_text


def test_context_free_tokenizer_equals_plain_decode():
    tok = smollm2_tokenizer()
    out = tok.encode(TEXTS[0], add_special_tokens=False)
    _, _, _, det = _stream(tok, [1, 2, 3], out, SamplingParams())
    assert det.output_text == tok.decode(out, skip_special_tokens=True)


def test_incomplete_bytes_flushed_at_finish(tok):
    out = tok.encode("ok 世界", add_special_tokens=False)
    # Cut inside the last character's bytes: the final text is what decode gives (U+FFFD).
    cut = out[:-1]
    assert tok.decode(cut).endswith("\ufffd")
    deltas, _, _, det = _stream(tok, [], cut, SamplingParams())
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas) == det.output_text
    if tok is smollm2_tokenizer():
        assert det.output_text == tok.decode(cut, skip_special_tokens=True)
    else:
        # tokenizers' ByteFallback turns a whole invalid byte run into U+FFFDs, "世" included;
        # streaming already emitted "世" (as vLLM does), so only the tail is replaced here.
        assert det.output_text.startswith("ok 世") and det.output_text.endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip):
    tok = smollm2_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out = tok.encode("Hi there", add_special_tokens=False) + [eos] + tok.encode(" more", add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=skip)
    deltas, _, _, det = _stream(tok, [], out, params)
    assert "".join(deltas) == tok.decode(out, skip_special_tokens=skip)
    assert ("<|im_end|>" in det.output_text) is (not skip)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tok, include):
    text = " hello the world. The end is near."
    out = tok.encode(text, add_special_tokens=False)
    stop_str = "ld. Th"
    params = SamplingParams(stop=["zzz", stop_str], include_stop_str_in_output=include)
    deltas, stop, used, det = _stream(tok, [], out, params)
    assert stop == stop_str
    # it matched on the token that completed it, not later
    assert stop_str in _expected(tok, [], out[:used]) and stop_str not in _expected(tok, [], out[:used - 1])
    want = " hello the wor" + (stop_str if include else "")
    assert det.output_text.lstrip() == want.lstrip()
    assert "".join(deltas) == det.output_text
    # nothing of the stop string leaked into the stream before the match
    if not include:
        assert all("ld" not in d for d in deltas)


def test_holdback_releases_text_that_cannot_start_a_stop_string():
    tok = smollm2_tokenizer()
    out = tok.encode("a b c d e f", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["e X"]))
    seen = ""
    for t in out:
        assert det.update([t]) is None
        seen += det.get_next_output_text(finished=False, delta=True)
        # held back: only a tail that is a prefix of "e X"
        assert det.output_text.startswith(seen)
        assert det.output_text[len(seen):] in ("", "e", "e ")
    seen += det.get_next_output_text(finished=True, delta=True)
    assert seen == "a b c d e f"
    assert det.get_next_output_text(finished=True, delta=False) == "a b c d e f"


def test_min_tokens_delays_stop_strings_and_stop_token_text_is_dropped():
    tok = smollm2_tokenizer()
    out = tok.encode("stop here stop there", add_special_tokens=False)
    params = SamplingParams(stop=["stop"], min_tokens=2)
    det = IncrementalDetokenizer(tok, [], params)
    assert det.update(out[:1]) is None  # "stop" inside the first min_tokens tokens: ignored
    for t in out[1:]:
        if (stop := det.update([t])) is not None:
            break
    assert stop == "stop"
    assert det.output_text == "stop here "

    # A stop token (stop_token_ids) ends the request: its text is not in the output.
    ids = tok.encode("Hi!", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop_token_ids=[ids[-1]]))
    det.update(ids[:-1])
    det.update(ids[-1:], stop_terminated=True)
    assert det.get_next_output_text(finished=True, delta=False) == tok.decode(ids[:-1])


def test_cumulative_mode_and_window_stays_small():
    tok = smollm2_tokenizer()
    out = tok.encode("word 🙂 " * 300, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [1, 2], SamplingParams())
    last = ""
    for t in out:
        det.update([t])
        cur = det.get_next_output_text(finished=False, delta=False)
        assert cur.startswith(last)
        last = cur
        assert len(det._decoder) < 80  # O(window), not O(sequence)
    assert det.get_next_output_text(finished=True, delta=False) == tok.decode(out)


def test_detokenize_false():
    tok = smollm2_tokenizer()
    det = IncrementalDetokenizer(tok, [1], SamplingParams(detokenize=False))
    assert det.update([5, 6]) is None
    assert det.output_text == "" and det.num_output_tokens == 2


class _SlowOnly:
    """The same tokenizer without its Rust backend: what a slow (Python) tokenizer looks like."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, **kwargs):
        return self._tok.decode(ids, **kwargs)


def test_fast_path_for_fast_tokenizers_slow_path_otherwise(tok):
    from jaxlm.engine.detokenizer import FastDecoder, SlowDecoder

    prompt = tok.encode("Say:", add_special_tokens=False)
    assert isinstance(IncrementalDetokenizer(tok, prompt, SamplingParams())._decoder, FastDecoder)
    assert isinstance(IncrementalDetokenizer(_SlowOnly(tok), prompt, SamplingParams())._decoder, SlowDecoder)
    # A prompt whose last tokens end inside a character: DecodeStream would drop it as context.
    cut = tok.encode("ok 世", add_special_tokens=False)[:-1]
    assert tok.decode(cut).endswith("\ufffd")
    assert isinstance(IncrementalDetokenizer(tok, cut, SamplingParams())._decoder, SlowDecoder)


@pytest.mark.parametrize("seed", range(3))
def test_fast_path_equals_the_python_window_on_random_ids(tok, seed):
    """Random ids (invalid byte runs, special tokens, prompts cut mid-character), several per
    step: DecodeStream, with its hand-over to the Python window where it refuses a step, gives
    exactly the Python window's deltas."""
    import random

    rng = random.Random(seed)
    handed_over = 0
    for _ in range(40):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 7))]
        out = [rng.randrange(len(tok)) for _ in range(24)]
        params = SamplingParams(skip_special_tokens=rng.random() < 0.5, stop=["e"] if rng.random() < 0.3 else None)
        chunk = rng.randint(1, 3)
        fast, _, _, det = _stream(tok, prompt, out, params, chunk)
        slow, _, _, _ = _stream(_SlowOnly(tok), prompt, out, params, chunk)
        assert fast == slow, (prompt, out)
        handed_over += getattr(det._decoder, "_slow", None) is not None
    if tok is byte_fallback_tokenizer():
        assert handed_over > 0  # the hand-over itself was exercised
