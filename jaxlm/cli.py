"""The `jaxlm` console script: `jaxlm serve MODEL [flags]` (as `vllm serve`), `jaxlm bench
latency|throughput|serve` (as `vllm bench`), `jaxlm --version`."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from jaxlm.serve.__main__ import main as serve_main

        return serve_main(argv[1:], prog="jaxlm serve")
    if argv[:1] == ["bench"]:
        from jaxlm.benchmarks.cli import main as bench_main

        return bench_main(argv[1:], prog="jaxlm bench")
    from jaxlm import __version__

    parser = argparse.ArgumentParser(prog="jaxlm", description="jaxlm: LLM inference and serving on JAX/XLA.")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("serve", help="OpenAI-compatible server (`jaxlm serve MODEL --help` for its flags)")
    sub.add_parser("bench", help="benchmarks: latency, throughput, serve (`jaxlm bench --help`)")
    parser.parse_args(argv)  # exits with usage: `serve` and `bench` are handled above
    return 2


if __name__ == "__main__":
    sys.exit(main())
