"""`python -m jaxlm.serve` flags: the server's own, then every engine argument (EngineArgs)."""

from __future__ import annotations

import argparse
import os

from jaxlm.engine.arg_utils import EngineArgs


def make_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxlm.serve",
        description="OpenAI-compatible HTTP server (vLLM's API) for a jaxlm engine.",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 = every interface)")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    server.add_argument(
        "--api-key",
        default=os.environ.get("JAXLM_API_KEY") or os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXLM_API_KEY, else $VLLM_API_KEY, else none)",
    )
    server.add_argument("--shutdown-timeout", type=int, default=30,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted (default 30)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default info)")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="no per-request access log")
    engine = parser.add_argument_group("engine")
    EngineArgs.add_cli_args(engine)  # --model, --served-model-name, --max-model-len, ...
    return parser
