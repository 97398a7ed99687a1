"""/v1/chat/completions: messages (and tools) through the tokenizer's chat template; the
output as content, reasoning_content (--reasoning-parser) and tool_calls (tool_choice, and
--tool-call-parser under "auto"), whole or as deltas."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from jaxlm.engine.input_processor import ProcessedPrompt
from jaxlm.entrypoints.chat_utils import NoChatTemplateError, apply_chat_template, parse_chat_messages
from jaxlm.multimodal.inputs import ChatImages
from jaxlm.outputs import Logprob
from jaxlm.reasoning import ReasoningParser, ReasoningParserManager
from jaxlm.serve.chat_output import ChatOutputParsers, ChoiceOutput
from jaxlm.serve.chat_template import render_chat_request
from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol import ChatMessage, UsageInfo
from jaxlm.serve.protocol_chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from jaxlm.serve.serving_engine import OpenAIServing
from jaxlm.serve.stream_utils import (
    ChoiceState,
    add_prompt_logprobs,
    clamp_logprob,
    prompt_logprobs_json,
    sse,
    sse_error,
)
from jaxlm.serve.structured import structured_outputs_for, with_reasoning_end
from jaxlm.serve.tool_choice import effective_tool_choice, forced_tool_parser, tool_choice_constraint
from jaxlm.serve.tool_parsers import ToolParser, ToolParserManager

logger = logging.getLogger(__name__)


def _finish_auto(called: bool, reason: str | None) -> str | None:
    return "tool_calls" if called else reason


def _finish_required(called: bool, reason: str | None) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class OpenAIServingChat(OpenAIServing):
    # --tool-call-parser under --enable-auto-tool-choice, and --reasoning-parser (configure()).
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None

    def configure(self, args: argparse.Namespace) -> None:
        """The server's tool-calling and reasoning flags; unknown parser names are refused by the
        argument parser, a tokenizer a parser cannot use fails here, at start-up."""
        if self.tokenizer is None and (getattr(args, "enable_auto_tool_choice", False)
                                       or getattr(args, "reasoning_parser", None)):
            raise ValueError("--tool-call-parser and --reasoning-parser read text: they need a tokenizer "
                             "(drop --skip-tokenizer-init)")
        if getattr(args, "enable_auto_tool_choice", False):
            self.tool_parser = ToolParserManager.get_tool_parser(args.tool_call_parser)
            self.tool_parser(self.tokenizer)
        if getattr(args, "reasoning_parser", None):
            self.reasoning_parser = ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
            if not self.reasoning_parser(self.tokenizer).reasoning_end_token_ids:
                logger.warning("reasoning parser %s: the tokenizer has no single token for the end of the "
                               "reasoning; output constraints apply from the first token", args.reasoning_parser)

    def _output_parsers(self, request: ChatCompletionRequest, prompt_ids: list[int]) -> ChatOutputParsers:
        parsers = ChatOutputParsers(single_tool_call=request.parallel_tool_calls is False,
                                    include_reasoning=request.include_reasoning)
        if self.reasoning_parser is not None:
            parsers.reasoning = partial(self.reasoning_parser, self.tokenizer)
            parsers.prompt_reasoning_ended = parsers.reasoning().is_reasoning_end(prompt_ids)
        choice = effective_tool_choice(request)
        if request.tools and choice == "auto":
            if self.tool_parser is None:
                raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                  "to be set", 400, "tool_choice")
            parsers.tools, parsers.finish_as_tool_calls = partial(self.tool_parser, self.tokenizer), _finish_auto
        elif choice != "none":
            parsers.tools = partial(forced_tool_parser, request, self.tokenizer)
            if choice == "required":
                parsers.finish_as_tool_calls = _finish_required
        return parsers

    def _constraint(self, request: ChatCompletionRequest, parsers: ChatOutputParsers) -> Any:
        """The request's output constraint; with a reasoning parser it starts after the reasoning."""
        so = structured_outputs_for(request, tool_choice_constraint(request))
        if so is not None and parsers.reasoning is not None and not parsers.prompt_reasoning_ended:
            end_ids = parsers.reasoning().reasoning_end_token_ids
            if end_ids:
                so = with_reasoning_end(so, end_ids)
        return so

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
               add_special_tokens: bool = False) -> ProcessedPrompt:
        """Chat template (--chat-template, else the tokenizer's: chat_utils decides) -> the prompt
        (the template carries BOS: no special tokens added again unless add_special_tokens, as vLLM);
        image_url parts become the model's placeholders and its processor's features."""
        images = self.input_processor.chat_images()  # None: a text-only model refuses image parts
        conversation = parse_chat_messages(messages, images)
        try:
            text = apply_chat_template(self.tokenizer, conversation, self.chat_template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **(kwargs or {}))
        except NoChatTemplateError as e:
            raise OpenAIError(str(e), 400, e.param) from e
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIError(f"chat template failed: {e}", 400, "messages") from e
        return self.prompt_of(text, images, add_special_tokens)

    def prompt_of(self, text: str, images: ChatImages | None, add_special_tokens: bool) -> ProcessedPrompt:
        """A rendered chat's prompt: its token ids, and with images the processor's expansion."""
        if images is None or not images.images:
            return ProcessedPrompt(None, self.encode(text, add_special_tokens=add_special_tokens))
        return self.input_processor.process_multimodal(text, images.images, add_special_tokens)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Any = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        arrival_time = time.time()  # before tokenization: TTFT counts from here (as vLLM)
        self.check_engine()
        request_id = f"chatcmpl-{self._base_request_id(raw_request, request.request_id)}"
        model = self.check_model(request.model)
        self.check_request_fields(request)
        if self.tool_parser is not None and request.tools:
            request = self.tool_parser(self.tokenizer).adjust_request(request)
        prompt = await render_chat_request(self, request)  # off the event loop; request templates gated
        ids, mm_features = prompt.prompt_token_ids, prompt.mm_features
        if mm_features and request.truncate_prompt_tokens is not None:
            raise OpenAIError("truncate_prompt_tokens would cut image placeholders: not supported with images",
                              400, "truncate_prompt_tokens")
        ids = self.truncate(ids, request.truncate_prompt_tokens)
        self.check_token_ids(ids)
        parsers = self._output_parsers(request, ids)
        structured_outputs = self._constraint(request, parsers)
        max_tokens = self.resolve_max_tokens(len(ids), request.requested_max_tokens())
        params = self.build_params(request.to_sampling_params, max_tokens, structured_outputs)
        beam_search = self.beam_search_params(request, params)
        if mm_features and beam_search is not None:
            raise OpenAIError("beam search with images is not supported", 400, "use_beam_search")
        gen = self.generate(ids, params, request_id, arrival_time, priority=request.priority,
                            beam_search=beam_search, model=model, mm_features=mm_features)
        try:
            first = await anext(gen)  # errors before the first output keep their HTTP status
        except StopAsyncIteration:
            raise OpenAIError("the engine returned no output", 500) from None
        except BaseException:
            await gen.aclose()
            raise
        if request.stream:
            return self._stream(request, model, request_id, ids, first, gen, parsers)
        states: dict[int, ChoiceState] = {}
        prompt_lps: dict[int, list] = {}
        out = first
        while True:
            add_prompt_logprobs(prompt_lps, 0, out)
            for o in out.outputs:
                states.setdefault(o.index, ChoiceState()).add(o)
            if out.finished:
                break
            try:
                out = await anext(gen)
            except StopAsyncIteration:
                break
        choices = []
        for i in range(request.n):
            st = states.get(i, ChoiceState())
            out_parser = parsers.for_choice()
            message, called = out_parser.message(st.text, request)
            choices.append(ChatCompletionResponseChoice(
                index=i,
                message=message,
                logprobs=self._logprobs(request, st.token_ids, st.logprobs) if request.logprobs else None,
                finish_reason=out_parser.finish_reason(st.finish_reason, called),
                stop_reason=st.stop_reason,
                **request.token_ids_fields(st.token_ids),
            ))
        completion_tokens = sum(len(s.token_ids) for s in states.values())
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                          total_tokens=len(ids) + completion_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                      prompt_logprobs=prompt_logprobs_json(prompt_lps.get(0)),
                                      **request.token_ids_fields(None, ids))

    async def _stream(self, request, model, request_id, prompt_ids, first, gen,
                      parsers: ChatOutputParsers) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        completion_tokens = 0

        prompt_len = len(prompt_ids)

        def chunk(choice: ChatCompletionResponseStreamChoice, **extra: list[int]) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice],
                                                    **extra))

        try:
            # OpenAI sends the role first, once per choice, with empty content.
            for i in range(request.n):
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None),
                    **request.token_ids_fields(None, prompt_ids if i == 0 else None))
            outputs: dict[int, ChoiceOutput] = {}
            out = first
            while out is not None:
                for o in out.outputs:
                    completion_tokens += len(o.token_ids)
                    logprobs = self._logprobs(request, o.token_ids, o.logprobs) if request.logprobs else None
                    out_parser = outputs.setdefault(o.index, parsers.for_choice())
                    delta = DeltaMessage(content=o.text) if out_parser.plain else out_parser.delta(o.text, request)
                    if (delta is not None and (delta.content or not out_parser.plain)) \
                            or (logprobs and logprobs.content) or (request.return_token_ids and o.token_ids):
                        yield chunk(ChatCompletionResponseStreamChoice(
                            index=o.index, delta=delta or DeltaMessage(), logprobs=logprobs,
                            **request.token_ids_fields(o.token_ids)))
                    if o.finish_reason is not None:
                        rest = out_parser.flush(request)
                        if rest is not None:
                            yield chunk(ChatCompletionResponseStreamChoice(index=o.index, delta=rest))
                        yield chunk(ChatCompletionResponseStreamChoice(
                            index=o.index, delta=DeltaMessage(), finish_reason=out_parser.finish_reason(o.finish_reason),
                            stop_reason=o.stop_reason))
                out = None if out.finished else await anext(gen, None)
            if include_usage:
                usage = UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                                  total_tokens=prompt_len + completion_tokens)
                yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                       choices=[], usage=usage))
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in-stream
            yield sse_error(e)
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                  logprobs: list[dict[int, Logprob]] | None) -> ChatCompletionLogProbs:
        content = []
        lps = list(logprobs or [])
        as_ids = bool(request.return_tokens_as_token_ids)
        for token_id, pos in zip(token_ids, lps):
            chosen = pos.get(token_id) if pos else None
            token = self.token_str(token_id, chosen, as_ids)
            top = self.top_entries(pos or {}, request.top_logprobs or 0)
            content.append(ChatCompletionLogProbsContent(
                token=token,
                logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
                bytes=list(token.encode("utf-8", errors="replace")),
                top_logprobs=[
                    ChatCompletionLogProb(token=(s := self.token_str(t, lp, as_ids)), logprob=clamp_logprob(lp.logprob),
                                          bytes=list(s.encode("utf-8", errors="replace")))
                    for t, lp in top
                ],
            ))
        return ChatCompletionLogProbs(content=content)
