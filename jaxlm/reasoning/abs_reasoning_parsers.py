"""ReasoningParser: the interface, and the registry --reasoning-parser names come from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ReasoningDelta:
    """What one streamed text delta adds to the reasoning and to the answer."""

    reasoning_content: str | None = None
    content: str | None = None


class ReasoningParser(ABC):
    """Splits one generation into reasoning and content. One instance per generated sequence:
    the streaming method keeps state between deltas."""

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer

    @property
    def reasoning_end_token_ids(self) -> list[int]:
        """Token ids that end the reasoning (a constraint starts after them); empty when the
        tokenizer has no single token for the end marker."""
        return []

    @abstractmethod
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """True when the reasoning is over at the end of input_ids (e.g. a prompt whose template
        closed the thinking block already: the generation is all answer)."""

    @abstractmethod
    def extract_reasoning_content(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole generation."""

    @abstractmethod
    def extract_reasoning_content_streaming(self, previous_text: str, current_text: str,
                                            delta_text: str) -> ReasoningDelta | None:
        """What delta_text (current_text = previous_text + delta_text) adds; None: nothing yet."""


class ReasoningParserManager:
    """Name -> ReasoningParser class (vLLM's registry)."""

    reasoning_parsers: ClassVar[dict[str, type[ReasoningParser]]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        def register(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            cls.reasoning_parsers[name] = parser
            return parser
        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        try:
            return cls.reasoning_parsers[name]
        except KeyError:
            raise ValueError(f"unknown reasoning parser {name!r}; known: "
                             f"{', '.join(sorted(cls.reasoning_parsers))}") from None
