"""ToolParser: turns a model's text into OpenAI tool calls (whole, or delta by delta while
streaming), and the registry --tool-call-parser names come from (vLLM's names).

A parser says where the calls lie in the text (``locate``: the plain content before them and
one CallSpan per call); this base class builds both the non-streaming result and the streamed
deltas from that one answer, so streamed calls reassemble into the non-streaming ones. One
instance per generated sequence: streaming keeps what it has sent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from jaxlm.serve.protocol_chat import DeltaMessage
from jaxlm.serve.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from jaxlm.serve.tool_parsers.json_spans import CallSpan


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


@dataclass
class _SentCall:
    id: str
    arguments_len: int = 0


class ToolParser(ABC):
    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer
        self._sent_calls: list[_SentCall] = []
        self._sent_content = 0

    @abstractmethod
    def locate(self, text: str, final: bool) -> tuple[str, list[CallSpan]]:
        """(plain content, the calls found). final=False: the text may still grow, so content
        that might be the start of a call marker is left out."""

    def adjust_request(self, request: Any) -> Any:
        """A hook to change the request before it runs (vLLM's); unchanged by default."""
        return request

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        content, spans = self.locate(model_output, final=True)
        if not spans or not all(s.is_valid(model_output) for s in spans):
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        calls = [ToolCall(function=FunctionCall(name=s.name, arguments=s.arguments(model_output)))
                 for s in spans]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     request: Any) -> DeltaMessage | None:
        """What delta_text adds: new content, then for each call its id, type and name once the
        name is complete, then its arguments text as it grows. None: nothing to send yet."""
        content, spans = self.locate(current_text, final=False)
        new_content = content[self._sent_content:]
        self._sent_content = max(self._sent_content, len(content))
        deltas = self._tool_call_deltas(current_text, spans)
        if not new_content and not deltas:
            return None
        return DeltaMessage(content=new_content or None, tool_calls=deltas or None)

    @property
    def tools_called(self) -> bool:
        """Streaming: some call has been sent."""
        return bool(self._sent_calls)

    def _tool_call_deltas(self, text: str, spans: list[CallSpan]) -> list[DeltaToolCall]:
        deltas = []
        for index, span in enumerate(spans):
            if span.name is None:
                break
            function = DeltaFunctionCall()
            delta = DeltaToolCall(index=index, function=function)
            if index == len(self._sent_calls):
                self._sent_calls.append(_SentCall(make_tool_call_id()))
                delta.id, delta.type, function.name = self._sent_calls[index].id, "function", span.name
            sent = self._sent_calls[index]
            arguments = span.arguments(text) or ""
            if len(arguments) > sent.arguments_len:
                function.arguments = arguments[sent.arguments_len:]
                sent.arguments_len = len(arguments)
            if delta.id is not None or function.arguments is not None:
                deltas.append(delta)
        return deltas


class ToolParserManager:
    """Name -> ToolParser class (vLLM's registry)."""

    tool_parsers: ClassVar[dict[str, type[ToolParser]]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            cls.tool_parsers[name] = parser
            return parser
        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        try:
            return cls.tool_parsers[name]
        except KeyError:
            raise ValueError(f"unknown tool call parser {name!r}; known: "
                             f"{', '.join(sorted(cls.tool_parsers))}") from None
