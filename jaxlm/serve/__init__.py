"""OpenAI-compatible HTTP server: `python -m jaxlm.serve --model PATH`."""

from jaxlm.serve.api_server import build_app, init_app_state, run_server
from jaxlm.serve.cli_args import make_arg_parser

__all__ = ["build_app", "init_app_state", "make_arg_parser", "run_server"]
