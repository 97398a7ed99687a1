"""Reasoning parsers on text and token ids: whole outputs and streamed deltas agree."""

from __future__ import annotations

import pytest

from jaxlm.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParserManager


class _Vocab:
    vocab = {"<think>": 5, "</think>": 6, "<unk>": 0}

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, 0)

    def convert_ids_to_tokens(self, tid):
        return {v: k for k, v in self.vocab.items()}[tid]


def stream(parser, text, size):
    reasoning, content, previous = "", "", ""
    for i in range(0, len(text), size):
        piece = text[i:i + size]
        delta = parser.extract_reasoning_content_streaming(previous, previous + piece, piece)
        previous += piece
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
    return reasoning or None, content or None


@pytest.mark.parametrize("cls,text,expected", [
    (Qwen3ReasoningParser, "<think>a < b</think>The answer", ("a < b", "The answer")),
    (Qwen3ReasoningParser, "No thinking </think> here", (None, "No thinking </think> here")),
    (Qwen3ReasoningParser, "<think>cut off", ("cut off", None)),
    (Qwen3ReasoningParser, "<thin", (None, "<thin")),
    (DeepSeekR1ReasoningParser, "thoughts</think>{\"a\": 1}", ("thoughts", '{"a": 1}')),
    (DeepSeekR1ReasoningParser, "<think>x</think>", ("x", None)),
    (DeepSeekR1ReasoningParser, "still thinking </th", ("still thinking </th", None)),
])
@pytest.mark.parametrize("size", [1, 3, 100])
def test_whole_and_streamed_agree(cls, text, expected, size):
    assert cls(None).extract_reasoning_content(text) == expected
    got = stream(cls(None), text, size)
    # A stream holds back what may be a marker's start; the server flushes it at the end.
    if text.endswith("</th") or text == "<thin":
        assert text.startswith((got[0] or "") + (got[1] or "")) or got == (None, None)
    else:
        assert got == expected


def test_token_ids():
    parser = Qwen3ReasoningParser(_Vocab())
    assert parser.reasoning_end_token_ids == [6]
    assert parser.is_reasoning_end([1, 5, 9, 6, 2]) and not parser.is_reasoning_end([6, 5, 9])
    assert not parser.is_reasoning_end([1, 2]) and Qwen3ReasoningParser(None).reasoning_end_token_ids == []


def test_registry():
    assert ReasoningParserManager.get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningParserManager.get_reasoning_parser("nope")


def test_end_token_id_from_a_real_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from tests.helpers.tiny_tokenizer import write_byte_tokenizer

    tok = PreTrainedTokenizerFast.from_pretrained(write_byte_tokenizer(tmp_path))
    assert DeepSeekR1ReasoningParser(tok).reasoning_end_token_ids == []  # no single </think> token
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    parser = DeepSeekR1ReasoningParser(tok)
    assert parser.reasoning_end_token_ids == [tok.convert_tokens_to_ids("</think>")]
    assert parser.is_reasoning_end(tok.encode("<think>x</think>y", add_special_tokens=False))
