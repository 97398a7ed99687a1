"""`jaxlm bench throughput`: vLLM's offline throughput benchmark, every prompt at once through LLM.generate.

    jaxlm bench throughput --dataset-name random --random-input-len 256 --random-output-len 128 \\
        --num-prompts 64 --output-json tput.json [any `jaxlm serve` engine flag]

Prints vLLM's line (requests/s, total tokens/s, output tokens/s) and writes vLLM's keys
(elapsed_time, num_requests, total_num_tokens, requests_per_second, tokens_per_second) beside the
serving keys of jaxlm/benchmarks/metrics.py (request_throughput, output_throughput, TTFT/TPOT/E2EL
from the engine's per-request timestamps). Sampling as vLLM's: temperature 1, ignore_eos.
The engine compiles its programs when it is built, before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from jaxlm.benchmarks.datasets import add_dataset_args

OFFLINE_METRICS = "ttft,tpot,e2el"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from jaxlm.engine.arg_utils import EngineArgs

    add_dataset_args(parser, seed=False)  # the engine's --seed seeds the prompts too, as in vLLM
    g = parser.add_argument_group("results")
    g.add_argument("--output-json", default=None, help="write the results here")
    g.add_argument("--metric-percentiles", default="50,99", help="percentiles of TTFT/TPOT/E2EL")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)


def run_throughput(llm: Any, requests: list, disable_tqdm: bool = True) -> tuple[list, float, float]:
    """(outputs, elapsed seconds, start on time.time()'s clock) of one LLM.generate over every request."""
    from jaxlm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} if r.prompt_token_ids else r.prompt for r in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len)
              for r in requests]
    wall0, t0 = time.time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not disable_tqdm)
    return outputs, time.perf_counter() - t0, wall0


def throughput_result(outputs: list, elapsed: float, wall0: float, percentiles: list[float]) -> dict[str, Any]:
    from jaxlm.benchmarks.metrics import calculate_metrics
    from jaxlm.benchmarks.offline import outcomes_from_outputs

    res = calculate_metrics(outcomes_from_outputs(outputs, wall0), elapsed, OFFLINE_METRICS.split(","), percentiles)
    total = res["total_input_tokens"] + res["total_output_tokens"]
    return {"elapsed_time": elapsed, "num_requests": len(outputs), "total_num_tokens": total,
            "requests_per_second": len(outputs) / elapsed, "tokens_per_second": total / elapsed, **res}


def main(args: argparse.Namespace) -> int:
    from jaxlm import LLM
    from jaxlm.benchmarks.datasets import get_samples
    from jaxlm.benchmarks.metrics import parse_percentile_args
    from jaxlm.benchmarks.offline import engine_kwargs, load_tokenizer

    try:
        _, percentiles = parse_percentile_args(OFFLINE_METRICS, args.metric_percentiles)
        requests = get_samples(args, load_tokenizer(args), args.seed)
    except ValueError as e:
        print(f"jaxlm bench throughput: {e}")
        return 1
    llm = LLM(**engine_kwargs(args))
    outputs, elapsed, wall0 = run_throughput(llm, requests, args.disable_tqdm)
    res = throughput_result(outputs, elapsed, wall0, percentiles)
    print(f"Throughput: {res['requests_per_second']:.2f} requests/s, {res['tokens_per_second']:.2f} total tokens/s, "
          f"{res['output_throughput']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {res['total_input_tokens']}")
    print(f"Total num output tokens:  {res['total_output_tokens']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=4)
    return 0
