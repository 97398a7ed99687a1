"""/v1/chat/completions: messages through the tokenizer's chat template, role/content deltas."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from jaxlm.outputs import Logprob
from jaxlm.serve.chat_template import render_chat_request
from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    random_uuid,
)
from jaxlm.serve.serving_engine import (
    ChoiceState,
    OpenAIServing,
    add_prompt_logprobs,
    clamp_logprob,
    prompt_logprobs_json,
    sse,
    sse_error,
)


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(f"unsupported content part type {part.get('type')!r}", 400, "messages")
        texts.append(part["text"])
    return "\n".join(texts)


class OpenAIServingChat(OpenAIServing):
    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
               add_special_tokens: bool = False) -> list[int]:
        """Chat template -> token ids (the template carries BOS: no special tokens added again
        unless add_special_tokens, as vLLM)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("this model's tokenizer has no chat template", 400, "messages")
        conversation = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(kwargs or {}),
            )
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIError(f"chat template failed: {e}", 400, "messages") from e
        return self.encode(text, add_special_tokens=add_special_tokens)

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        arrival_time = time.time()  # before tokenization: TTFT counts from here (as vLLM)
        self.check_engine()
        model = self.check_model(request.model)
        self.check_request_fields(request)
        ids = await render_chat_request(self, request)  # off the event loop; request templates gated
        ids = self.truncate(ids, request.truncate_prompt_tokens)
        self.check_token_ids(ids)
        max_tokens = self.resolve_max_tokens(len(ids), request.requested_max_tokens())
        params = self.build_params(request.to_sampling_params, max_tokens)
        request_id = f"chatcmpl-{request.request_id or random_uuid()}"
        gen = self.generate(ids, params, request_id, arrival_time)
        try:
            first = await anext(gen)  # errors before the first output keep their HTTP status
        except StopAsyncIteration:
            raise OpenAIError("the engine returned no output", 500) from None
        except BaseException:
            await gen.aclose()
            raise
        if request.stream:
            return self._stream(request, model, request_id, len(ids), first, gen)
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
            choices.append(ChatCompletionResponseChoice(
                index=i,
                message=ChatResponseMessage(content=st.text),
                logprobs=self._logprobs(request, st.token_ids, st.logprobs) if request.logprobs else None,
                finish_reason=st.finish_reason,
                stop_reason=st.stop_reason,
            ))
        completion_tokens = sum(len(s.token_ids) for s in states.values())
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                          total_tokens=len(ids) + completion_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                      prompt_logprobs=prompt_logprobs_json(prompt_lps.get(0)))

    async def _stream(self, request, model, request_id, prompt_len, first, gen) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        completion_tokens = 0

        def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))

        try:
            # OpenAI sends the role first, once per choice, with empty content.
            for i in range(request.n):
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None))
            out = first
            while out is not None:
                for o in out.outputs:
                    completion_tokens += len(o.token_ids)
                    logprobs = self._logprobs(request, o.token_ids, o.logprobs) if request.logprobs else None
                    if o.text or (logprobs and logprobs.content):
                        yield chunk(ChatCompletionResponseStreamChoice(
                            index=o.index, delta=DeltaMessage(content=o.text), logprobs=logprobs))
                    if o.finish_reason is not None:
                        yield chunk(ChatCompletionResponseStreamChoice(
                            index=o.index, delta=DeltaMessage(), finish_reason=o.finish_reason,
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
