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
    core_launcher = None
    try:
        if args.data_parallel_size == 1 and args.nnodes == 1:
            # The engine core's process first: it imports jax and the model code while this
            # process imports the front end (fastapi, transformers) and loads the tokenizer.
            from jaxlm.engine.core_launcher import CoreLauncher

            core_launcher = CoreLauncher()
        # Imported after parsing: --help and flag errors never load jax, fastapi or the engine.
        from jaxlm.serve.api_server import AddressInUseError, run_server

        try:
            return run_server(args, core_launcher=core_launcher)
        except AddressInUseError as e:
            logger.error("%s", e)
            return 1
    except KeyboardInterrupt:  # Ctrl-C before serving started: no traceback
        logger.info("interrupted")
        return 130
    finally:
        if core_launcher is not None:
            core_launcher.cancel()  # never handed its config (the engine failed first): end it


if __name__ == "__main__":
    sys.exit(main())
