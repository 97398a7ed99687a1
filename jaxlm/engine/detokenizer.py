"""Incremental detokenization and stop strings (vLLM's IncrementalDetokenizer behaviour).

Text is produced with a prefix/read-offset window over token ids: each token decodes only the
tokens since the last emitted text plus the window before them, so a step costs O(new tokens).
Text is emitted only once it does not end in U+FFFD, so a multi-byte character split over
several (byte-fallback / byte-level) tokens never shows up half-decoded; whatever is still
pending when the request finishes is flushed, so the final text equals decoding all output
tokens at once (with the prompt's last tokens as context, as vLLM does).

Two decoders run that one algorithm:
  * FastDecoder: the `tokenizers` library's own streaming decoder (`DecodeStream`, what vLLM's
    fast incremental detokenizer uses): one Rust call per token, ~4x cheaper than the two
    decodes and the string work per token of the Python window.
  * SlowDecoder: the window in Python over `decode` calls. Kept for tokenizers without a Rust
    backend (slow HF tokenizers: sentencepiece-only, tiktoken or remote-code ones) and, per
    request, where DecodeStream's results would differ: a prompt whose last tokens end inside a
    character (DecodeStream then ignores the prompt as context), and a step DecodeStream refuses
    ("Invalid prefix": a decoder whose text for a window is not a prefix of the next one, e.g.
    Metaspace + ByteFallback + Strip, Llama-2/Mistral style, over an invalid byte run). The fast
    decoder mirrors its window's ids, so it hands its state over to the slow one at that token.
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


def rust_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast tokenizer (or the tokenizer itself), else None."""
    from tokenizers import Tokenizer

    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """ids -> text, without clean-up of tokenization spaces (vLLM never cleans up either).

    Fast tokenizers (and raw `tokenizers.Tokenizer`) go straight to the Rust decoder; they
    ignore spaces_between_special_tokens, exactly like HF's fast decode and vLLM's fast path.
    """
    backend = rust_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False)


class SlowDecoder:
    """The prefix/read-offset window in Python over `decode` calls."""

    def __init__(self, decode: Any, window: list[int], read_offset: int) -> None:
        self._decode = decode
        self._ids = window  # ids[prefix_offset:read_offset] decoded to text already emitted
        self._prefix_offset = 0
        self._read_offset = read_offset
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached

    def __len__(self) -> int:
        """Token ids held as decoding context (stays O(window), not O(sequence))."""
        return len(self._ids)

    def step(self, token: int) -> str:
        """Text that became final with this token ('' while a character is incomplete)."""
        ids = self._ids
        ids.append(token)
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

    def flush(self) -> str:
        """Text still held back at the end (e.g. a trailing incomplete byte sequence)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._read_offset = len(self._ids)
        self._prefix_offset = self._read_offset
        self._prefix_text = None
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


class FastDecoder:
    """DecodeStream, with a mirror of its window (the ids of the text last emitted, then the
    ids still pending) to flush at the end and to hand over to a SlowDecoder when it refuses."""

    def __init__(self, stream: Any, backend: Any, decode: Any, context: list[int]) -> None:
        self._stream, self._backend, self._decode = stream, backend, decode
        self._window, self._pending = context, []
        self._slow: SlowDecoder | None = None

    def __len__(self) -> int:
        return len(self._slow) if self._slow is not None else len(self._window) + len(self._pending)

    def step(self, token: int) -> str:
        if self._slow is not None:
            return self._slow.step(token)
        try:
            text = self._stream.step(self._backend, token)
        except Exception:  # noqa: BLE001 - "Invalid prefix": the Python window takes over here
            window = self._window + self._pending
            self._slow = SlowDecoder(self._decode, window, len(self._window))
            self._stream = None
            return self._slow.step(token)
        self._pending.append(token)
        if text is None:
            return ""
        self._window, self._pending = self._pending, []
        return text

    def flush(self) -> str:
        if self._slow is not None:
            return self._slow.flush()
        if not self._pending:
            return ""
        text = SlowDecoder(self._decode, self._window + self._pending, len(self._window)).flush()
        self._window, self._pending = self._window + self._pending, []
        return text


def make_decoder(tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> Any:
    """A FastDecoder where DecodeStream gives the Python window's text, else a SlowDecoder."""
    decode = make_decode_fn(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
    context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
    backend = rust_backend(tokenizer)
    # A context ending inside a character: DecodeStream would not take it as its prefix.
    if backend is not None and not (context and decode(context).endswith(_REPLACEMENT)):
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        except (ImportError, TypeError):  # tokenizers < 0.22: no DecodeStream(ids=...)
            stream = None
        if stream is not None:
            return FastDecoder(stream, backend, decode, context)
    return SlowDecoder(decode, context, len(context))


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
        self.num_output_tokens = 0
        self.output_text = ""
        self.stop_reason: str | None = None
        # Of the last update's tokens, how many came after the one completing a stop string
        # (several tokens in one step: speculative decoding); they are not part of the output.
        self.tokens_past_stop = 0
        self._last_output_text_offset = 0
        self._decoder = make_decoder(tokenizer, prompt_token_ids, params) if self.enabled else None

    @property
    def fast(self) -> bool:
        """Whether DecodeStream decodes this request (still: it may hand over mid-stream)."""
        return isinstance(self._decoder, FastDecoder) and self._decoder._slow is None

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Add the step's tokens; return the stop string that matched (the request must then
        finish with finish_reason "stop", stop_reason = that string), else None.

        stop_terminated: the last token is a stop token (eos / stop_token_ids) that ended the
        request; its text is left out unless include_stop_str_in_output (vLLM's rule).
        """
        if not new_token_ids:
            return None
        n_before = self.num_output_tokens
        self.num_output_tokens += len(new_token_ids)
        if not self.enabled:
            return None
        if not (self.stop or self.min_tokens or stop_terminated):  # nothing to watch: only decode
            step = self._decoder.step
            for tok in new_token_ids:
                self.output_text += step(tok)
            return None
        to_decode = new_token_ids[:-1] if stop_terminated and not self.include_stop_str_in_output else new_token_ids
        stop_check_offset = len(self.output_text)
        step, min_tokens = self._decoder.step, self.min_tokens
        several = bool(self.stop) and len(to_decode) > 1
        pieces = []
        for i, tok in enumerate(to_decode):
            pieces.append(step(tok))
            # Stop strings may not end inside the first min_tokens tokens.
            if min_tokens and n_before + i + 1 <= min_tokens:
                self.output_text += "".join(pieces)
                pieces.clear()
                stop_check_offset = len(self.output_text)
            elif several and i + 1 < len(to_decode):  # the output ends with the token completing one
                self.output_text += "".join(pieces)
                pieces.clear()
                stop_str = self._check_stop(stop_check_offset)
                if stop_str is not None:
                    self.tokens_past_stop = len(new_token_ids) - i - 1
                    self.num_output_tokens -= self.tokens_past_stop
                    return stop_str
        if pieces:
            self.output_text += pieces[0] if len(pieces) == 1 else "".join(pieces)
        if not self.stop or self.num_output_tokens <= min_tokens:
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

    def _flush(self) -> None:
        """Emit text still held back at the end (e.g. a trailing incomplete byte sequence)."""
        if self.enabled and self.stop_reason is None:
            self.output_text += self._decoder.flush()

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
        length = len(self.output_text) - (self._holdback() if self.stop and not finished else 0)
        if not delta:
            return self.output_text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self.output_text[last:length]
        return ""
