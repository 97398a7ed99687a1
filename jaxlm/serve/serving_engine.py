"""OpenAIServing: what completions and chat share — model check, tokenization, length checks,
metrics around the engine stream, logprob formatting, and merging several prompts' streams."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pydantic import BaseModel

from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.engine.exceptions import QueueFullError
from jaxlm.engine.input_processor import InvalidRequestError, ProcessedPrompt, PromptTooLongError
from jaxlm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxlm.sampling_params import SamplingParams
from jaxlm.serve.errors import OpenAIError, error_response, to_openai_error
from jaxlm.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)
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


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: list[str],
        max_model_len: int,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.metrics = metrics

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if not model:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
        return model

    def check_engine(self) -> None:
        if not self.engine.is_running:
            raise OpenAIError("the engine is not running", 503)

    @property
    def input_processor(self) -> Any:
        """The engine's InputProcessor: the one place prompts and params are checked."""
        return self.engine.get_input_processor()

    def check_token_ids(self, ids: list[int]) -> None:
        try:
            self.input_processor.check_prompt_token_ids(ids)
        except InvalidRequestError as e:
            raise OpenAIError(str(e), 400, e.param) from e

    def resolve_max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """Rejects prompts that fill the context; clamps max_tokens to the room left (as vLLM)."""
        ip = self.input_processor
        try:
            ip.check_prompt_len(prompt_len)
        except PromptTooLongError as e:
            raise _context_length_error(e) from e
        return ip.max_tokens_for(prompt_len, requested)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot take
            raise OpenAIError(f"the text cannot be tokenized: {e}", 400, "prompt") from e

    def build_params(self, make: Any, max_tokens: int) -> SamplingParams:
        try:
            return make(max_tokens)
        except ValueError as e:  # SamplingParams' own validation: a client error
            raise OpenAIError(str(e), 400) from e

    # ------------------------------------------------------------ generation
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """engine.generate plus the request-level metrics (TTFT, ITL, e2e, finish reason).

        prompt_ids have passed check_token_ids and resolve_max_tokens (the InputProcessor's
        prompt checks), so the engine takes them as a ProcessedPrompt without checking again."""
        start = time.monotonic()
        first = last = None
        reasons: list[str] = []
        finished = rejected = False
        prompt = ProcessedPrompt(None, list(prompt_ids))
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                now = time.monotonic()
                if any(o.token_ids for o in out.outputs):
                    if first is None:
                        self.metrics.observe_first_token(now - start)
                    else:
                        self.metrics.observe_inter_token(now - last)
                    first = first or now
                    last = now
                reasons.extend(o.finish_reason for o in out.outputs if o.finish_reason)
                finished = out.finished
                yield out
        except PromptTooLongError as e:
            rejected = True  # never ran: not a finished request
            raise _context_length_error(e) from e
        except InvalidRequestError as e:
            rejected = True
            raise OpenAIError(str(e), 400, e.param) from e
        except (ValueError, QueueFullError):
            rejected = True
            raise
        finally:
            if not rejected:
                reason = "abort"
                if finished:
                    reason = "length" if reasons and all(r == "length" for r in reasons) else "stop"
                self.metrics.observe_finished(reason, time.monotonic() - start)

    # ------------------------------------------------------------ logprobs
    def token_str(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    def top_entries(self, position: dict[int, Logprob], limit: int | None) -> list[tuple[int, Logprob]]:
        items = sorted(position.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
        return items if limit is None else items[:limit]


def _context_length_error(e: PromptTooLongError) -> OpenAIError:
    return OpenAIError(
        f"This model's maximum context length is {e.max_model_len} tokens. However, your "
        f"request has {e.prompt_len} input tokens. Please reduce the length of the input.",
        400,
        "prompt",
    )


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
