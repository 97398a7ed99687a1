"""The FastAPI app (build_app / init_app_state) and the uvicorn launcher (run_server): limits,
middleware, the listening socket, the engine watchdog. The routes live in jaxlm/serve/routes/."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

import jaxlm
from jaxlm.config.model import load_chat_template
from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.serve.chat_template import ChatTemplatePolicy
from jaxlm.serve.errors import install_error_handlers
from jaxlm.serve.metrics import ServerMetrics, cache_config_info
from jaxlm.serve.middleware import AuthenticationMiddleware, BodyLimitMiddleware
from jaxlm.serve.request_logger import RequestLogger
from jaxlm.serve.routes import ROUTERS
from jaxlm.serve.routes.lora import router as lora_router
from jaxlm.serve.serving_models import ServingModels, runtime_lora_updating_allowed
from jaxlm.serve.serving_chat import OpenAIServingChat
from jaxlm.serve.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)

# After the engine dies, the process exits this long after asking uvicorn to stop, even if a
# connection is still draining (a supervisor restarts it).
_DEAD_ENGINE_EXIT_S = 5.0
_LISTEN_BACKLOG = 2048


class AddressInUseError(OSError):
    """The port is taken (bound or listening by another process)."""


def build_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI(title="jaxlm OpenAI-compatible server", version=jaxlm.__version__)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if runtime_lora_updating_allowed():  # vLLM's switch: POST /v1/load_lora_adapter, /v1/unload_lora_adapter
        app.include_router(lora_router)
    # add_middleware wraps: the last added runs first (CORS, then the key, then the body limit).
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes,
                       idle_timeout_s=args.request_header_timeout)
    api_keys = getattr(args, "api_key", None) or []  # --api-key: a list (several keys), as vLLM
    if api_keys:
        app.add_middleware(AuthenticationMiddleware, api_keys=list(api_keys), guard_probes=args.guard_probes)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                       allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    app.state.max_prompts_per_request = args.max_prompts_per_request
    app.state.enable_tokenizer_info_endpoint = getattr(args, "enable_tokenizer_info_endpoint", False)
    return app


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
                                  cache_config_info(engine.engine_config.cache_config),
                                  num_engines=engine.engine_config.parallel_config.data_parallel_size,
                                  model_config=engine.engine_config.model_config)
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    request_logger = _request_logger(args, engine.engine_config.observability_config)
    state.models = ServingModels(engine, names, model_config.model, max_model_len,
                                 getattr(args, "lora_modules", None))
    state.serving_completion = OpenAIServingCompletion(engine, names, max_model_len, state.metrics, chat_template,
                                                       request_logger, state.models)
    state.serving_chat = OpenAIServingChat(engine, names, max_model_len, state.metrics, chat_template,
                                           request_logger, state.models)
    state.serving_chat.template_policy = ChatTemplatePolicy(
        trust_request_chat_template=args.trust_request_chat_template, timeout_s=args.chat_template_timeout)
    state.serving_chat.configure(args)  # tool-call and reasoning parsers


def _request_logger(args: argparse.Namespace, observability: Any) -> RequestLogger | None:
    """--enable-log-requests / --max-log-len, from the server's flags or the engine's config."""
    if not (getattr(args, "enable_log_requests", False) or observability.enable_log_requests):
        return None
    max_log_len = getattr(args, "max_log_len", None)
    return RequestLogger(max_log_len if max_log_len is not None else observability.max_log_len)


def create_server_socket(host: str, port: int) -> socket.socket:
    """Bound AND listening before the engine loads, so a second server on the port fails at
    once (Linux lets two SO_REUSEADDR sockets bind one port while neither listens)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(_LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise AddressInUseError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than
    timeout_s to arrive (uvicorn itself only times out idle keep-alive connections)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request on this keep-alive connection

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete and self._header_timer:
                self._header_timer.cancel()  # headers are in: the app owns the request now
                self._header_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_timed_out)

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol


def build_server(app: FastAPI, args: argparse.Namespace) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        http=header_timeout_protocol(args.request_header_timeout),
        log_level=getattr(args, "uvicorn_log_level", "info"),
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        timeout_graceful_shutdown=getattr(args, "shutdown_timeout", None),
        timeout_keep_alive=5,
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    return uvicorn.Server(config)


def _watch_engine(engine: AsyncLLMEngine, server: uvicorn.Server) -> None:
    """When the engine dies, stop serving (every open request already has its error) and make
    sure the process goes away soon, so a supervisor restarts it."""
    engine.wait_until_dead()
    logger.error("the engine died: stopping the server (exit code 1)")
    server.should_exit = True
    timer = threading.Timer(_DEAD_ENGINE_EXIT_S, lambda: os._exit(1))
    timer.daemon = True
    timer.start()


def run_server(args: argparse.Namespace, engine: AsyncLLMEngine | None = None, core_launcher: Any = None) -> int:
    """Listens, loads the engine, serves until SIGTERM/SIGINT, drains and returns 0; returns 1
    when the engine died. core_launcher: the engine core's process, started early by the CLI."""
    sock = create_server_socket(args.host, args.port)
    if engine is None:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args), core_launcher=core_launcher)
    app = build_app(args)
    init_app_state(engine, app.state, args)
    server = build_server(app, args)
    threading.Thread(target=_watch_engine, args=(engine, server), name="jaxlm-engine-watchdog", daemon=True).start()
    # uvicorn stops accepting on SIGTERM/SIGINT, lets in-flight requests finish (up to
    # --shutdown-timeout, then cancels them, which aborts them), and afterwards re-raises the
    # signal to the handler that was there before it: make that a no-op so both exit cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: logger.info("%s: server stopped", signal.Signals(signum).name))
    logger.info("jaxlm API server on http%s://%s:%d (models: %s)", "s" if args.ssl_certfile else "",
                args.host, sock.getsockname()[1], ", ".join(app.state.served_model_names))
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown(abort_requests=True)
        sock.close()
    return 1 if engine.errored else 0
