"""`jaxlm bench SUBCOMMAND` (and `python -m jaxlm.bench`): vLLM's `vllm bench` subcommands, and
jaxlm's own questions (start-up, host overhead, kernels) with their own flags.

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
# Subcommands that parse their own flags: subcommand -> (module, one-line help).
OWN_FLAGS = {
    "startup": ("startup", "server start-up, cold and warm: seconds to the first 200 on /health"),
    "host-overhead": ("host_overhead", "ms of host work per decode step, by part (--vs DIR: against another checkout)"),
    "kernels": ("kernels", "decode attention kernels on a GPU: time and HBM bandwidth"),
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
    for name, (_, help_) in OWN_FLAGS.items():
        sub.add_parser(name, help=help_, add_help=False)  # listed here; parsed by the module (below)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "jaxlm bench") -> int:
    import logging

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in OWN_FLAGS:
        mod = importlib.import_module(f"jaxlm.benchmarks.{OWN_FLAGS[argv[0]][0]}")
        return int(mod.main(argv[1:]) or 0)
    args = make_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args._main(args) or 0)
