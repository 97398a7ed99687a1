"""`python -m jaxlm.serve [MODEL] [--port 8000] ...`: the OpenAI-compatible server."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from jaxlm.serve.cli_args import make_arg_parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxlm.serve") -> int:
    args = make_arg_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported after parsing: --help and flag errors never load jax, fastapi or the engine.
    from jaxlm.serve.api_server import run_server

    run_server(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
