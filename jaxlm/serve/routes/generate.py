"""/v1/completions and /v1/chat/completions: admission limits, client-disconnect handling, SSE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxlm.serve.errors import OpenAIError, to_openai_error
from jaxlm.serve.protocol import CompletionRequest
from jaxlm.serve.protocol_chat import ChatCompletionRequest
from jaxlm.serve.serving_chat import OpenAIServingChat
from jaxlm.serve.serving_completion import OpenAIServingCompletion

T = TypeVar("T")
router = APIRouter()


class SSEResponse(StreamingResponse):
    """Server-sent events that notice a vanished client even while waiting on the engine, and
    always close the body iterator, so a disconnect aborts the request and frees its KV blocks."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Runs a handler's work, cancelling it (and so aborting its engine requests) if the client
    disconnects first; returns None in that case."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # e.g. the shutdown timeout: abort the work too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    try:
        return task.result()
    except Exception as e:  # noqa: BLE001
        # Known engine errors become OpenAIError here: Starlette re-raises what reaches its
        # catch-all 500 handler, and uvicorn then drops the keep-alive connection.
        raise to_openai_error(e) from e


def respond(result: Any) -> Response:
    if isinstance(result, AsyncIterator):
        return SSEResponse(result)
    if result is None:  # client gone: nobody reads this
        return Response(status_code=499)
    return JSONResponse(result.model_dump())


def num_prompts(prompt: Any) -> int:
    """How many prompts a completion request carries (a string or one token list is one)."""
    if isinstance(prompt, str) or not prompt or all(isinstance(x, int) for x in prompt):
        return 1
    return len(prompt)


def check_fair_share(raw: Request, prompts: int, n: int) -> None:
    """At most --max-prompts-per-request prompts; and n × prompts sequences must fit the waiting
    queue as that many requests would (429 otherwise, before any of them is queued)."""
    limit = raw.app.state.max_prompts_per_request
    if prompts > limit:
        raise OpenAIError(f"{prompts} prompts in one request; at most {limit} (--max-prompts-per-request)",
                          400, "prompt")
    try:
        raw.app.state.engine.check_queue_room(prompts * n)
    except Exception as e:  # noqa: BLE001 - QueueFullError -> 429
        raise to_openai_error(e) from e


@router.post("/v1/completions")
async def completions(request: CompletionRequest, raw: Request) -> Response:
    check_fair_share(raw, num_prompts(request.prompt), request.n)
    serving: OpenAIServingCompletion = raw.app.state.serving_completion
    return respond(await until_disconnected(raw, serving.create_completion(request, raw)))


@router.post("/v1/chat/completions")
async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
    check_fair_share(raw, 1, request.n)
    serving: OpenAIServingChat = raw.app.state.serving_chat
    return respond(await until_disconnected(raw, serving.create_chat_completion(request, raw)))
