"""Reasoning + tool parsers together on one choice's text, and the constraint a reasoning
parser defers (no engine)."""

from __future__ import annotations

from functools import partial

from jaxlm.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from jaxlm.serve.chat_output import ChatOutputParsers
from jaxlm.serve.protocol_chat import ChatCompletionRequest
from jaxlm.serve.serving_chat import OpenAIServingChat, _finish_auto
from jaxlm.serve.tool_parsers import Hermes2ProToolParser

REQUEST = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], guided_regex="a+")
TEXT = 'thinking about <tools></think>Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


class _Vocab:
    vocab = {"<think>": 5, "</think>": 6, "<unk>": 0}

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, 0)

    def convert_ids_to_tokens(self, tid):
        return {v: k for k, v in self.vocab.items()}[tid]


def _parsers(**kw) -> ChatOutputParsers:
    return ChatOutputParsers(reasoning=partial(DeepSeekR1ReasoningParser, None),
                             tools=partial(Hermes2ProToolParser, None), finish_as_tool_calls=_finish_auto, **kw)


def test_reasoning_then_tool_calls_whole_and_streamed():
    message, called = _parsers().for_choice().message(TEXT, REQUEST)
    assert called and message.reasoning_content == "thinking about <tools>" and message.content == "Sure. "
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("f", '{"x": 1}')]
    for size in (1, 4, 1000):
        out = _parsers().for_choice()
        got = {"reasoning_content": "", "content": "", "arguments": "", "name": None}
        deltas = [out.delta(TEXT[i:i + size], REQUEST) for i in range(0, len(TEXT), size)]
        for d in [*deltas, out.flush(REQUEST)]:
            if d is None:
                continue
            got["reasoning_content"] += d.reasoning_content or ""
            got["content"] += d.content or ""
            for tc in d.tool_calls or []:
                got["name"] = got["name"] or tc.function.name
                got["arguments"] += tc.function.arguments or ""
        assert got == {"reasoning_content": "thinking about <tools>", "content": "Sure. ", "arguments": '{"x": 1}',
                       "name": "f"}
        assert out.finish_reason("stop") == "tool_calls"


def test_held_back_text_is_flushed_at_the_end():
    out = ChatOutputParsers(reasoning=partial(Qwen3ReasoningParser, None)).for_choice()
    text = "<think>cut off at </thi"
    sent = "".join(d.reasoning_content or "" for d in (out.delta(c, REQUEST) for c in text) if d)
    assert sent + out.flush(REQUEST).reasoning_content == "cut off at </thi"


def test_the_constraint_waits_for_the_reasoning_end_unless_the_prompt_closed_it():
    reasoning = partial(DeepSeekR1ReasoningParser, _Vocab())
    so = OpenAIServingChat._constraint(None, REQUEST, ChatOutputParsers(reasoning=reasoning))
    assert so.regex == "a+" and so.reasoning_end_token_ids == [6]
    closed = ChatOutputParsers(reasoning=reasoning, prompt_reasoning_ended=True)
    assert OpenAIServingChat._constraint(None, REQUEST, closed).reasoning_end_token_ids is None
    assert closed.for_choice().message("all answer", REQUEST)[0].content == "all answer"


def test_tools_reach_the_chat_template_whatever_the_tool_choice():
    from jaxlm.serve.chat_template import template_kwargs

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="none",
                                    chat_template_kwargs={"enable_thinking": False})
    assert template_kwargs(request) == {"enable_thinking": False, "tools": [tool]}


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}'
            "</tool_call>")
    single = ChatOutputParsers(tools=partial(Hermes2ProToolParser, None), single_tool_call=True)
    message, called = single.for_choice().message(text, REQUEST)
    assert called and [c.function.name for c in message.tool_calls] == ["f"]
    out = single.for_choice()
    names = [tc.function.name for c in text for d in [out.delta(c, REQUEST)] if d for tc in d.tool_calls or []]
    assert [n for n in names if n] == ["f"]


def test_include_reasoning_false_drops_the_reasoning():
    parsers = ChatOutputParsers(reasoning=partial(DeepSeekR1ReasoningParser, None), include_reasoning=False)
    message, _ = parsers.for_choice().message("hmm</think>answer", REQUEST)
    assert (message.reasoning_content, message.content) == (None, "answer")
    out = parsers.for_choice()
    deltas = [d for d in (out.delta(c, REQUEST) for c in "hmm</think>answer") if d]
    assert "".join(d.content or "" for d in deltas) == "answer" and not any(d.reasoning_content for d in deltas)
