"""One chat choice's text -> message fields: reasoning (--reasoning-parser) first, then tool
calls in what follows (a forced tool_choice's parser, or --tool-call-parser under "auto").
The same objects serve the non-streaming result and the stream's deltas."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxlm.reasoning.abs_reasoning_parsers import ReasoningParser
from jaxlm.serve.protocol_chat import ChatResponseMessage, DeltaMessage
from jaxlm.serve.tool_parsers.abstract_tool_parser import ToolParser


@dataclass
class ChatOutputParsers:
    """Makes the parsers of one request's choices (fresh per choice: streaming is stateful)."""

    reasoning: Callable[[], ReasoningParser] | None = None
    tools: Callable[[], ToolParser] | None = None
    # True when the prompt closed the reasoning already (the output is all answer).
    prompt_reasoning_ended: bool = False
    # "required" and named choices report tool_calls by finish_reason differently (vLLM's rules).
    finish_as_tool_calls: Callable[[bool, str | None], str | None] = lambda called, reason: reason
    # parallel_tool_calls=False: only the first call is kept (vLLM's behaviour).
    single_tool_call: bool = False
    # include_reasoning=False (vLLM's): the reasoning is split off and dropped.
    include_reasoning: bool = True

    def for_choice(self) -> "ChoiceOutput":
        reasoning = self.reasoning() if self.reasoning and not self.prompt_reasoning_ended else None
        return ChoiceOutput(reasoning, self.tools() if self.tools else None, self.finish_as_tool_calls,
                            self.single_tool_call, self.include_reasoning)


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 finish: Callable[[bool, str | None], str | None], single_tool_call: bool = False,
                 include_reasoning: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._finish = finish
        self._max_calls = 1 if single_tool_call else None
        self._include_reasoning = include_reasoning
        self._text = ""  # streaming: everything generated
        self._answer = ""  # streaming: the part after the reasoning
        self._sent = {"reasoning_content": "", "content": ""}  # streaming: what deltas carried

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None

    def message(self, text: str, request: Any) -> tuple[ChatResponseMessage, bool]:
        """The non-streaming message and whether it calls tools."""
        reasoning, answer = (None, text) if self.reasoning is None else \
            self.reasoning.extract_reasoning_content(text)
        reasoning = reasoning if self._include_reasoning else None
        if self.tools is None:
            return ChatResponseMessage(content=answer, reasoning_content=reasoning), False
        info = self.tools.extract_tool_calls(answer or "", request)
        return ChatResponseMessage(content=info.content, reasoning_content=reasoning,
                                   tool_calls=info.tool_calls[:self._max_calls]), info.tools_called

    def delta(self, delta_text: str, request: Any) -> DeltaMessage | None:
        """What delta_text adds to the streamed message; None: nothing to send yet."""
        previous, self._text = self._text, self._text + delta_text
        reasoning_delta, answer_delta = None, delta_text
        if self.reasoning is not None:
            step = self.reasoning.extract_reasoning_content_streaming(previous, self._text, delta_text)
            reasoning_delta, answer_delta = (step.reasoning_content, step.content) if step else (None, None)
            reasoning_delta = reasoning_delta if self._include_reasoning else None
        out = DeltaMessage(reasoning_content=reasoning_delta, content=answer_delta or None)
        if self.tools is not None and answer_delta:
            previous_answer, self._answer = self._answer, self._answer + answer_delta
            step = self.tools.extract_tool_calls_streaming(previous_answer, self._answer, answer_delta, request)
            out.content, out.tool_calls = (step.content, step.tool_calls) if step else (None, None)
            if out.tool_calls and self._max_calls is not None:
                out.tool_calls = [tc for tc in out.tool_calls if tc.index < self._max_calls] or None
        if not (out.reasoning_content or out.content or out.tool_calls):
            return None
        self._sent["reasoning_content"] += out.reasoning_content or ""
        self._sent["content"] += out.content or ""
        return out

    def flush(self, request: Any) -> DeltaMessage | None:
        """At the end of the stream: the text the parsers held back (it might have been the
        start of a marker), so the deltas add up to the non-streaming message."""
        if self.plain:
            return None
        message, _ = self.message(self._text, request)
        rest = {}
        for name, sent in self._sent.items():
            final = getattr(message, name) or ""
            if len(final) > len(sent) and final.startswith(sent):
                rest[name] = final[len(sent):]
        return DeltaMessage(**rest) if rest else None

    def finish_reason(self, reason: str | None, tools_called: bool | None = None) -> str | None:
        called = self.tools is not None and (self.tools.tools_called if tools_called is None else tools_called)
        return self._finish(called, reason)
