"""`python -m jaxlm.serve [MODEL]` flags: the server's own (vLLM's spellings), then every engine
argument (EngineArgs, one group per config). Light: building the parser imports no jax."""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from jaxlm.config import parse_json_list
from jaxlm.engine.arg_utils import EngineArgs, HelpFormatter
from jaxlm.lora.module_path import parse_lora_module

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ServeArgumentParser(argparse.ArgumentParser):
    """Resolves what argparse cannot: the positional MODEL into --model, and the API keys'
    environment fallback (a list default would be extended in place by action="extend")."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        ns = super().parse_args(args, namespace)
        tag = getattr(ns, "model_tag", None)
        if tag is not None:
            if ns.model is not None and ns.model != tag:
                self.error(f"the model is given twice: positional {tag!r} and --model {ns.model!r}")
            ns.model = tag
        if ns.enable_auto_tool_choice and not ns.tool_call_parser:
            self.error("--enable-auto-tool-choice needs --tool-call-parser")
        if ns.api_key is None:
            env = os.environ.get("JAXLM_API_KEY") or os.environ.get("VLLM_API_KEY")
            ns.api_key = [env] if env else None
        return ns


def _json_list(text: str) -> list:
    try:
        return parse_json_list(text)
    except ValueError as e:  # json's errors are ValueErrors too
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list: {e}") from e


def _lora_module(text: str):
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server", "HTTP front end (vLLM's flags)")
    server.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="the model to serve (same as --model)")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 = every interface)")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    server.add_argument("--api-key", action="extend", nargs="+", default=None,
                        help="accepted 'Authorization: Bearer KEY' keys on every route but /health, /version "
                             "and /metrics, several allowed (None: $JAXLM_API_KEY, else $VLLM_API_KEY, else no check)")
    server.add_argument("--guard-probes", action="store_true",
                        help="require the API key on /health, /version and /metrics too")
    server.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins (JSON list)")
    server.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods (JSON list)")
    server.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers (JSON list)")
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    server.add_argument("--root-path", default=None, help="path prefix when served behind a proxy (ASGI root_path)")
    server.add_argument("--ssl-keyfile", default=None, help="TLS private key file")
    server.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a chat template in a request (chat_template, chat_template_kwargs); "
                             "rendered in a Jinja sandbox with --chat-template-timeout")
    server.add_argument("--chat-template-timeout", type=_positive_float, default=5.0,
                        help="seconds a request's chat template may take to render; past it the request fails")
    server.add_argument("--max-request-body-bytes", type=_positive_int, default=4 * 1024 * 1024,
                        help="largest request body accepted (413 beyond it)")
    server.add_argument("--request-header-timeout", type=_positive_float, default=15.0,
                        help="seconds a client may take to send a request's headers, or to send the next "
                             "body chunk, before the connection is dropped")
    server.add_argument("--max-prompts-per-request", type=_positive_int, default=64,
                        help="most prompts one /v1/completions request may batch")
    server.add_argument("--shutdown-timeout", type=int, default=30,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted")
    server.add_argument("--uvicorn-log-level", default="info", choices=_LOG_LEVELS, help="uvicorn's log level")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="no per-request access log")
    server.add_argument("--lora-modules", type=_lora_module, nargs="+", action="extend", default=None,
                        metavar="NAME=PATH",
                        help="LoRA adapters to serve (with --enable-lora): name=path or JSON "
                             '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request\'s model may name one')
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info (tokenizer config and chat template; lm-eval's remote tokenizer)")
    _add_tool_args(parser)


def _add_tool_args(parser: argparse.ArgumentParser) -> None:
    from jaxlm.reasoning import ReasoningParserManager
    from jaxlm.serve.tool_parsers import ToolParserManager

    tools = parser.add_argument_group("tool calling and reasoning", "chat completions (vLLM's flags)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the default when a request has tools): the model\'s '
                            "text is parsed into tool_calls by --tool-call-parser")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(ToolParserManager.tool_parsers),
                       help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>; "
                            "llama3_json: {\"name\": ..., \"parameters\": ...})")
    tools.add_argument("--reasoning-parser", default=None, choices=sorted(ReasoningParserManager.reasoning_parsers),
                       help="split <think>...</think> into reasoning_content; output constraints apply "
                            "after the reasoning ends")


# Engine arguments whose server default is not LLM's (the config's): a server answers /health
# before its warm start has loaded every program, or its cold start compiled every one; LLM
# has them all first.
SERVER_DEFAULTS = {"defer_program_load": True, "compile_in_background": True}


def make_arg_parser(prog: str = "python -m jaxlm.serve") -> ServeArgumentParser:
    parser = ServeArgumentParser(
        prog=prog,
        description="OpenAI-compatible HTTP server (vLLM's API) for a jaxlm engine.",
        formatter_class=HelpFormatter,
    )
    _add_server_args(parser)
    EngineArgs.add_cli_args(parser)  # --model, --max-model-len, --dtype, ... one group per config
    parser.set_defaults(**SERVER_DEFAULTS)
    return parser

