"""`python -m jaxlm.serve [--model PATH] [--port 8000] ...`: the OpenAI-compatible server."""

from __future__ import annotations

import logging
import sys

from jaxlm.serve.api_server import run_server
from jaxlm.serve.cli_args import make_arg_parser


def main(argv: list[str] | None = None) -> int:
    args = make_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
