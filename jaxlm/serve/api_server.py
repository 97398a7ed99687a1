"""The FastAPI app (build_app / init_app_state) and the uvicorn launcher (run_server)."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

import jaxlm
from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.serve.errors import OpenAIError, error_json, install_error_handlers, to_openai_error
from jaxlm.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from jaxlm.serve.metrics import ServerMetrics, cache_config_info
from jaxlm.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from jaxlm.serve.serving_chat import OpenAIServingChat
from jaxlm.serve.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)
T = TypeVar("T")


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


class AuthenticationMiddleware:
    """Bearer-token check on /v1/* (probes like /health and /metrics stay open). Plain ASGI, not
    BaseHTTPMiddleware, so streamed responses and disconnect events pass through untouched."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not any([hmac.compare_digest(given, key) for key in self.expected]):  # every key: constant time
                await error_json("Unauthorized: missing or invalid API key", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def _respond(result: Any) -> Response:
    if isinstance(result, AsyncIterator):
        return SSEResponse(result)
    if result is None:  # client gone: nobody reads this
        return Response(status_code=499)
    return JSONResponse(result.model_dump())


def build_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI(title="jaxlm OpenAI-compatible server", version=jaxlm_version())
    install_error_handlers(app)
    api_keys = getattr(args, "api_key", None) or []  # --api-key: a list (several keys), as vLLM

    if api_keys:
        app.add_middleware(AuthenticationMiddleware, api_keys=list(api_keys))

    @app.get("/health")
    async def health(raw: Request) -> Response:
        if not raw.app.state.engine.is_running:
            return error_json("engine is not running", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": jaxlm_version()})

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        return Response(raw.app.state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    if getattr(args, "enable_tokenizer_info_endpoint", False):  # opt-in, as vLLM (it shows the template)

        @app.get("/tokenizer_info")
        async def tokenizer_info(raw: Request) -> JSONResponse:
            return JSONResponse(raw.app.state.serving_completion.tokenizer_info())

    @app.get("/v1/models")
    async def models(raw: Request) -> JSONResponse:
        state = raw.app.state
        root = state.model_path
        cards = [ModelCard(id=name, root=root, max_model_len=state.max_model_len) for name in state.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        serving: OpenAIServingCompletion = raw.app.state.serving_completion
        return _respond(await until_disconnected(raw, serving.create_completion(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        serving: OpenAIServingChat = raw.app.state.serving_chat
        return _respond(await until_disconnected(raw, serving.create_chat_completion(request)))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest, raw: Request) -> JSONResponse:
        chat: OpenAIServingChat = raw.app.state.serving_chat
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", 400)
        if request.messages is not None:
            ids = chat.render(request.messages, request.add_generation_prompt)
        else:
            ids = chat.encode(request.prompt, request.add_special_tokens)
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=chat.max_model_len, tokens=ids).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest, raw: Request) -> JSONResponse:
        chat: OpenAIServingChat = raw.app.state.serving_chat
        chat.check_model(request.model)
        chat.check_token_ids(request.tokens)
        return JSONResponse(DetokenizeResponse(prompt=chat.tokenizer.decode(request.tokens)).model_dump())

    return app


def jaxlm_version() -> str:
    return getattr(jaxlm, "__version__", None) or "0.1.0"


def init_app_state(engine: AsyncLLMEngine, state: Any, args: argparse.Namespace) -> None:
    model_config = engine.engine_config.model_config
    max_model_len = engine.engine_config.scheduler_config.max_model_len
    # As vLLM: --served-model-name, else the --model argument; for the embedded default model,
    # the checkpoint's file name rather than a site-packages path.
    names = list(getattr(args, "served_model_name", None) or model_config.served_model_name or [])
    if not names and getattr(args, "model", None):
        names = [args.model]
    if not names:
        names = [os.path.basename(model_config.model or "SmolLM2-135M-Instruct").removesuffix(".gguf")]
    state.engine = engine
    state.served_model_names = names
    state.model_path = model_config.model
    state.max_model_len = max_model_len
    state.metrics = ServerMetrics(names[0], max_model_len, engine.get_stats,
                                  cache_config_info(engine.engine_config.cache_config))
    state.serving_completion = OpenAIServingCompletion(engine, names, max_model_len, state.metrics)
    state.serving_chat = OpenAIServingChat(engine, names, max_model_len, state.metrics)


def create_server_socket(host: str, port: int) -> socket.socket:
    """Bound before the engine loads, so a busy port fails fast (as vLLM does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def build_server(app: FastAPI, args: argparse.Namespace) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_level=getattr(args, "uvicorn_log_level", "info"),
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        timeout_graceful_shutdown=getattr(args, "shutdown_timeout", None),
        timeout_keep_alive=5,
    )
    return uvicorn.Server(config)


def run_server(args: argparse.Namespace, engine: AsyncLLMEngine | None = None) -> None:
    """Binds, loads the engine, serves until SIGTERM/SIGINT, then drains and exits cleanly."""
    sock = create_server_socket(args.host, args.port)
    if engine is None:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    app = build_app(args)
    init_app_state(engine, app.state, args)
    server = build_server(app, args)
    # uvicorn stops accepting on SIGTERM, lets in-flight requests finish (up to
    # --shutdown-timeout, then cancels them, which aborts them), and afterwards re-raises the
    # signal to the handler that was there before it: make that a no-op so we exit 0.
    signal.signal(signal.SIGTERM, lambda *_: logger.info("SIGTERM: server stopped"))
    logger.info("jaxlm API server on http://%s:%d (models: %s)", args.host, sock.getsockname()[1],
                ", ".join(app.state.served_model_names))
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown(abort_requests=True)
        sock.close()
