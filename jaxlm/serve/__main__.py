"""`python -m jaxlm.serve [MODEL] [--port 8000] ...`: the OpenAI-compatible server."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from jaxlm.serve.cli_args import make_arg_parser

logger = logging.getLogger("jaxlm.serve")


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxlm.serve") -> int:
    """0 after a clean stop (SIGTERM or Ctrl-C), 1 when the port is taken or the engine died,
    130 for Ctrl-C while the model loads."""
    args = make_arg_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.headless:  # a follower node of several: no API, rank 0's steps
        from jaxlm.executor.multihost_executor import run_headless

        return run_headless(args)
    try:
        # Imported after parsing: --help and flag errors never load jax, fastapi or the engine.
        from jaxlm.serve.api_server import AddressInUseError, run_server

        try:
            return run_server(args)
        except AddressInUseError as e:
            logger.error("%s", e)
            return 1
    except KeyboardInterrupt:  # Ctrl-C before serving started: no traceback
        logger.info("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
