"""What the completion and chat responses share once the engine has answered: SSE events, an
error inside a stream, logprob clamping, choices accumulated from DELTA outputs, prompt logprobs,
and merging several prompts' streams."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel

from jaxlm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxlm.serve.errors import error_response, to_openai_error
from jaxlm.serve.protocol import PromptLogprob

T = TypeVar("T")

# JSON has no -inf; OpenAI and vLLM report this instead.
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float | None) -> float | None:
    if value is None:
        return None
    return MIN_LOGPROB if (math.isinf(value) or math.isnan(value) or value < MIN_LOGPROB) else float(value)


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error inside a stream (status already sent): one OpenAI error event, then [DONE]."""
    err = to_openai_error(exc)
    return sse(json.dumps(error_response(err.message, err.status, err.param).model_dump()))


@dataclasses.dataclass
class ChoiceState:
    """One completion's text/tokens/logprobs, accumulated from DELTA outputs."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, out: CompletionOutput) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(out.logprobs)
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


def add_prompt_logprobs(prompt_lps: dict[int, list], p: int, out: RequestOutput) -> None:
    """DELTA outputs bring a prompt's logprobs chunk by chunk (one per prefill step): keep them
    all. With n > 1 every sequence computes them; the first one's are kept."""
    if out.prompt_logprobs is not None and all(o.index == 0 for o in out.outputs):
        prompt_lps.setdefault(p, []).extend(out.prompt_logprobs)


def prompt_logprobs_json(lps: list | None) -> list[dict[int, PromptLogprob] | None] | None:
    if lps is None:
        return None
    return [None if pos is None else {t: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                                       decoded_token=lp.decoded_token) for t, lp in pos.items()}
            for pos in lps]


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Interleaves several async iterators; closing the merge cancels (and so aborts) the rest."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, e))
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
