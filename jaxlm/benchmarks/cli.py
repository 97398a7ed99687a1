"""`jaxlm bench SUBCOMMAND` (and `python -m jaxlm.bench`): vLLM's `vllm bench` subcommands.

Building the parser imports no jax (`jaxlm bench --help` stays quick); each subcommand imports
what it runs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# subcommand -> (module under jaxlm.benchmarks, one-line help)
SUBCOMMANDS = {
    "latency": ("latency", "time of one batch, submission to last token (offline engine)"),
    "throughput": ("throughput", "tokens/s of every prompt at once (offline engine)"),
    "serve": ("serve", "client of a running OpenAI-compatible server: TTFT, TPOT, ITL, throughput"),
}


def make_parser(prog: str = "jaxlm bench") -> argparse.ArgumentParser:
    from jaxlm.engine.arg_utils import HelpFormatter

    class Formatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
        """The module docstring as written; every default shown."""

    parser = argparse.ArgumentParser(prog=prog, description="Benchmarks with vLLM's flags and result keys.")
    sub = parser.add_subparsers(dest="bench", metavar="SUBCOMMAND", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        mod = importlib.import_module(f"jaxlm.benchmarks.{module}")
        p = sub.add_parser(name, help=help_, description=mod.__doc__, formatter_class=Formatter)
        mod.add_cli_args(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "jaxlm bench") -> int:
    import logging

    args = make_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args._main(args) or 0)
