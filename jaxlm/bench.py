"""`python -m jaxlm.bench latency|throughput|serve ...`: the same as `jaxlm bench ...`."""

import sys

from jaxlm.benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m jaxlm.bench"))
