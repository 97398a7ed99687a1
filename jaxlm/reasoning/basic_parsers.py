"""BaseThinkingReasoningParser: reasoning between a start and an end marker (<think>...</think>).

Text-based, so it works whether or not the markers are single tokens; the end marker's token
id (when it is one token) is what the structured-output matcher waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxlm.reasoning.abs_reasoning_parsers import ReasoningDelta, ReasoningParser


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (text a stream
    must not emit yet: the marker may be arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def token_id(tokenizer: Any, token: str) -> int | None:
    """The id of token when it is one token of the vocabulary (a lookup, not get_vocab(): a
    parser is made per request), else None."""
    if tokenizer is None:
        return None
    tid = tokenizer.convert_tokens_to_ids(token)
    return tid if isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == token else None


class BaseThinkingReasoningParser(ReasoningParser):
    start_token: str = "<think>"
    end_token: str = "</think>"
    # True: an output that does not open with the start marker is all answer (the model did not
    # think). False: the output starts inside the reasoning (the template opened it); the start
    # marker is optional.
    requires_start_token: bool = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.start_token_id = token_id(tokenizer, self.start_token)
        self.end_token_id = token_id(tokenizer, self.end_token)
        self._emitted = 0  # streaming: characters of the reasoning already sent
        self._ended = False  # streaming: the rest is answer

    @property
    def reasoning_end_token_ids(self) -> list[int]:
        return [] if self.end_token_id is None else [self.end_token_id]

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for t in reversed(input_ids):
            if t == self.end_token_id:
                return True
            if t == self.start_token_id:
                return False
        return False

    def _split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer): answer None while the end marker has not come; reasoning None
        when the output does not reason at all."""
        if text.startswith(self.start_token):
            text = text[len(self.start_token):]
        elif self.requires_start_token:
            return None, text
        reasoning, sep, answer = text.partition(self.end_token)
        return reasoning, (answer if sep else None)

    def extract_reasoning_content(self, model_output: str) -> tuple[str | None, str | None]:
        reasoning, answer = self._split(model_output)
        return reasoning or None, answer or None

    def extract_reasoning_content_streaming(self, previous_text: str, current_text: str,
                                            delta_text: str) -> ReasoningDelta | None:
        if self._ended:
            return ReasoningDelta(content=delta_text) if delta_text else None
        if len(current_text) < len(self.start_token) and self.start_token.startswith(current_text):
            return None  # may be the start marker arriving
        reasoning, answer = self._split(current_text)
        if reasoning is None:  # no reasoning: everything (held back so far) is answer
            self._ended = True
            return ReasoningDelta(content=current_text) if current_text else None
        if answer is None:
            reasoning = reasoning[:len(reasoning) - held_back(reasoning, self.end_token)]
            new, self._emitted = reasoning[self._emitted:], len(reasoning)
            return ReasoningDelta(reasoning_content=new) if new else None
        self._ended = True
        delta = ReasoningDelta(reasoning_content=reasoning[self._emitted:] or None, content=answer or None)
        return delta if (delta.reasoning_content or delta.content) else None
