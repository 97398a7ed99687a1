"""Incremental detokenization and stop strings (vLLM's IncrementalDetokenizer behaviour).

Text is produced with a prefix/read-offset window over token ids: each step decodes only the
tokens since the last emitted text plus a few tokens of context, so a step costs O(new tokens).
Text is emitted only once it does not end in U+FFFD, so a multi-byte character split over
several (byte-fallback / byte-level) tokens never shows up half-decoded; whatever is still
pending when the request finishes is flushed, so the final text equals decoding all output
tokens at once (with the prompt's last tokens as context, as vLLM does).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jaxlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt tokens kept as decoding context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """ids -> text, without clean-up of tokenization spaces (vLLM never cleans up either).

    Fast tokenizers (and raw `tokenizers.Tokenizer`) go straight to the Rust decoder; they
    ignore spaces_between_special_tokens, exactly like HF's fast decode and vLLM's fast path.
    """
    from tokenizers import Tokenizer

    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False)


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """The first stop string (in `stop` order) found in the newest text, and where to cut.

    Only the last new_char_count + len(stop_str) - 1 characters are searched (older text was
    searched before). Returns (stop_str, truncate_to) with truncate_to = -1 for no cut.
    """
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        idx = output_text.find(stop_str, start)
        if idx == -1:
            continue
        if include_in_output:
            idx += len(stop_str)
            if idx >= len(output_text):
                return stop_str, -1
        return stop_str, idx
    return None


class IncrementalDetokenizer:
    """Per-request output text: `update()` each step, `get_next_output_text()` to stream it."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.enabled = tokenizer is not None and params.detokenize
        self.stop: list[str] = list(params.stop or []) if self.enabled else []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        # Of the last update's tokens, how many came after the one completing a stop string
        # (several tokens in one step: speculative decoding); they are not part of the output.
        self.tokens_past_stop = 0
        self._last_output_text_offset = 0
        if not self.enabled:
            return
        self._decode = make_decode_fn(tokenizer, params.skip_special_tokens,
                                      params.spaces_between_special_tokens)
        # Window of ids: a little prompt context, then the output tokens.
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached

    # ------------------------------------------------------------ decoding

    def _decode_next(self) -> str:
        """Text that became final with the newest token ('' while a character is incomplete)."""
        ids = self._ids
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(self._prefix_text):]
        # Slide the window; drop ids nobody will decode again so memory stays O(window).
        start = self._read_offset
        self._prefix_offset, self._read_offset = start, len(ids)
        self._prefix_text = None
        if start > 64:
            del ids[:start]
            self._read_offset -= start
            self._prefix_offset = 0
        return delta

    def _flush(self) -> None:
        """Emit text still held back at the end (e.g. a trailing incomplete byte sequence)."""
        if not self.enabled or self.stop_reason is not None or self._read_offset >= len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text):
            self.output_text += new_text[len(prefix_text):]
        self._read_offset = len(self._ids)
        self._prefix_offset = self._read_offset
        self._prefix_text = None

    # ------------------------------------------------------------ public API

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Add the step's tokens; return the stop string that matched (the request must then
        finish with finish_reason "stop", stop_reason = that string), else None.

        stop_terminated: the last token is a stop token (eos / stop_token_ids) that ended the
        request; its text is left out unless include_stop_str_in_output (vLLM's rule).
        """
        if not new_token_ids:
            return None
        self.output_token_ids.extend(new_token_ids)
        if not self.enabled:
            return None
        to_decode = list(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode.pop()  # the request is over: its stop token is never decoded
        stop_check_offset = len(self.output_text)
        n_before = len(self.output_token_ids) - len(new_token_ids)
        for i, tok in enumerate(to_decode):
            self._ids.append(tok)
            self.output_text += self._decode_next()
            # Stop strings may not end inside the first min_tokens tokens.
            if self.min_tokens and n_before + i + 1 <= self.min_tokens:
                stop_check_offset = len(self.output_text)
            elif self.stop and i + 1 < len(to_decode):  # the output ends with the token completing one
                stop_str = self._check_stop(stop_check_offset)
                if stop_str is not None:
                    self.tokens_past_stop = len(new_token_ids) - i - 1
                    del self.output_token_ids[n_before + i + 1:]
                    return stop_str
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._check_stop(stop_check_offset)

    def _check_stop(self, stop_check_offset: int) -> str | None:
        found = check_stop_strings(self.output_text, len(self.output_text) - stop_check_offset,
                                   self.stop, self.include_stop_str_in_output)
        if found is None:
            return None
        stop_str, truncate_to = found
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        self.stop_reason = stop_str
        return stop_str

    def _holdback(self) -> int:
        """Characters at the end that could still become a stop string (not emitted yet)."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        text = self.output_text
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Full text (delta=False) or only what is new since the last call (delta=True).

        While unfinished, the tail that could be the start of a stop string is held back.
        """
        if finished:
            self._flush()
        length = len(self.output_text) - (0 if finished else self._holdback())
        if not delta:
            return self.output_text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self.output_text[last:length]
        return ""
