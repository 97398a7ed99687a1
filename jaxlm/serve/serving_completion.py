"""/v1/completions: prompts as text, lists of text or token ids; streaming, echo, legacy logprobs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxlm.outputs import Logprob, RequestOutput
from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from jaxlm.serve.serving_engine import OpenAIServing
from jaxlm.serve.stream_utils import (
    ChoiceState,
    add_prompt_logprobs,
    clamp_logprob,
    prompt_logprobs_json,
    merge_async_iterators,
    sse,
    sse_error,
)
from jaxlm.serve.structured import structured_outputs_for


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt; the text is None where truncation cut it."""
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise OpenAIError("prompt must not be empty", 400, "prompt")
        result = []
        for item in items:
            text = item if isinstance(item, str) else None
            ids = self.encode(item, request.add_special_tokens) if text is not None else list(item)
            truncated = self.truncate(ids, request.truncate_prompt_tokens)
            if len(truncated) != len(ids):
                text, ids = None, truncated
            self.check_token_ids(ids)
            result.append((text, ids))
        return result

    async def create_completion(
        self, request: CompletionRequest, raw_request: Any = None
    ) -> CompletionResponse | AsyncIterator[str]:
        """The response, or (stream=True) an SSE iterator whose first output already arrived, so
        that queue-full and invalid-prompt errors still get their HTTP status."""
        arrival_time = time.time()  # before tokenization: TTFT counts from here (as vLLM)
        self.check_engine()
        request_id = f"cmpl-{self._base_request_id(raw_request, request.request_id)}"
        model = self.check_model(request.model)
        if request.suffix:
            raise OpenAIError("suffix is not supported", 400, "suffix")
        self.check_request_fields(request)
        if request.max_tokens == 0 and not request.echo:
            raise OpenAIError("max_tokens must be at least 1 (0 only with echo: scoring the prompt)", 400,
                              "max_tokens")
        structured_outputs = structured_outputs_for(request)
        prompts = await asyncio.to_thread(self._prompts, request)  # tokenization off the event loop
        generators = []
        for i, (text, ids) in enumerate(prompts):
            # echo with max_tokens=0: one token is generated (the engine always samples) and dropped.
            max_tokens = self.resolve_max_tokens(len(ids), 1 if request.echo_only else request.max_tokens)
            params = self.build_params(request.to_sampling_params, max_tokens, structured_outputs)
            generators.append(self.generate(ids, params, f"{request_id}-{i}", arrival_time, text,
                                            priority=request.priority,
                                            beam_search=self.beam_search_params(request, params), model=model))
        merged = merge_async_iterators(*generators)
        try:
            first = await anext(merged)
        except StopAsyncIteration:
            raise OpenAIError("the engine returned no output", 500) from None
        except BaseException:
            await merged.aclose()
            raise
        if request.stream:
            return self._stream(request, model, request_id, prompts, first, merged)
        return await self._full(request, model, request_id, prompts, first, merged)

    # ------------------------------------------------------------ non-streaming
    async def _full(self, request, model, request_id, prompts, first, merged) -> CompletionResponse:
        states: dict[tuple[int, int], ChoiceState] = {}
        prompt_lps: dict[int, list] = {}

        def take(p: int, out: RequestOutput) -> None:
            add_prompt_logprobs(prompt_lps, p, out)
            for o in out.outputs:
                states.setdefault((p, o.index), ChoiceState()).add(o)

        take(*first)
        async for p, out in merged:
            take(p, out)
        choices = []
        completion_tokens = 0
        for p, (text, ids) in enumerate(prompts):
            prompt_text = text if text is not None else self.decode(ids)
            for i in range(request.n):
                st = states.get((p, i), ChoiceState())
                if request.echo_only:
                    st = ChoiceState(finish_reason="length")  # the prompt alone (vLLM's scoring)
                completion_tokens += len(st.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._legacy_logprobs(request, ids, prompt_lps.get(p), st.token_ids, st.logprobs)
                choices.append(
                    CompletionResponseChoice(
                        index=p * request.n + i,
                        text=(prompt_text if request.echo else "") + st.text,
                        logprobs=logprobs,
                        finish_reason=st.finish_reason,
                        stop_reason=st.stop_reason,
                        prompt_logprobs=prompt_logprobs_json(prompt_lps.get(p)),
                        **request.token_ids_fields(st.token_ids, ids),
                    )
                )
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    # ------------------------------------------------------------ streaming
    async def _stream(self, request, model, request_id, prompts, first, merged) -> AsyncIterator[str]:
        created = int(time.time())
        n = request.n
        offsets: dict[int, int] = {}  # choice index -> text offset so far (legacy logprobs)
        started: set[int] = set()
        prompt_lps: dict[int, list] = {}
        completion_tokens = 0
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunks(p: int, out: RequestOutput) -> list[str]:
            nonlocal completion_tokens
            text_in, ids = prompts[p]
            add_prompt_logprobs(prompt_lps, p, out)
            result = []
            for o in out.outputs:
                if not o.token_ids and o.finish_reason is None:
                    continue  # a prefill chunk: the echo waits for the whole prompt's logprobs
                index = p * n + o.index
                token_ids, lps, text = o.token_ids, o.logprobs, o.text
                if request.echo_only:  # the prompt alone (vLLM's scoring)
                    token_ids, lps, text = [], None, ""
                completion_tokens += len(token_ids)
                prefix_ids: list[int] = []
                first_chunk = index not in started
                if first_chunk:
                    started.add(index)
                    if request.echo:
                        text = (text_in if text_in is not None else self.decode(ids)) + text
                        prefix_ids = ids
                wants_ids = request.logprobs is not None or request.return_token_ids
                if not text and o.finish_reason is None and not (wants_ids and token_ids):
                    continue
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._legacy_logprobs(
                        request, prefix_ids, prompt_lps.get(p) if prefix_ids else None,
                        token_ids, lps, start_offset=offsets.get(index, 0),
                    )
                offsets[index] = offsets.get(index, 0) + len(text)
                choice = CompletionResponseChoice(
                    index=index, text=text, logprobs=logprobs,
                    finish_reason="length" if request.echo_only else o.finish_reason,
                    stop_reason=None if request.echo_only else o.stop_reason,
                    **request.token_ids_fields(token_ids, ids if first_chunk else None),
                )
                result.append(sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])))
            return result

        try:
            for chunk in chunks(*first):
                yield chunk
            async for p, out in merged:
                for chunk in chunks(p, out):
                    yield chunk
            if include_usage:
                prompt_tokens = sum(len(ids) for _, ids in prompts)
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens)
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in-stream
            yield sse_error(e)
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ logprobs
    def _legacy_logprobs(
        self,
        request: CompletionRequest,
        prompt_ids: list[int],
        prompt_logprobs: list | None,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob]] | None,
        start_offset: int = 0,
    ) -> CompletionLogProbs:
        """OpenAI's legacy format: tokens, token_logprobs, top_logprobs, text_offset."""
        result = CompletionLogProbs()
        offset = start_offset
        positions: list[tuple[int, dict[int, Logprob] | None]] = []
        if request.echo and prompt_ids:
            plp = list(prompt_logprobs or [])
            plp += [None] * (len(prompt_ids) - len(plp))
            positions += list(zip(prompt_ids, plp))
        lps = list(logprobs or [])
        lps += [None] * (len(token_ids) - len(lps))
        positions += list(zip(token_ids, lps))
        as_ids = bool(request.return_tokens_as_token_ids)
        for token_id, pos in positions:
            chosen = pos.get(token_id) if pos else None
            token = self.token_str(token_id, chosen, as_ids)
            result.tokens.append(token)
            result.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            result.text_offset.append(offset)
            offset += len(token)
            if pos is None:
                result.top_logprobs.append(None)
            else:
                top = self.top_entries(pos, request.logprobs)
                if chosen is not None and all(t != token_id for t, _ in top):
                    top.append((token_id, chosen))  # OpenAI's top_logprobs include the sampled token
                result.top_logprobs.append({self.token_str(t, lp, as_ids): clamp_logprob(lp.logprob)
                                            for t, lp in top})
        return result

