"""`jaxlm bench latency`: vLLM's latency benchmark, the time of one batch from submission to its last token.

    jaxlm bench latency --input-len 32 --output-len 128 --batch-size 8 --num-iters 30 \\
        --output-json lat.json [any `jaxlm serve` engine flag]

--batch-size prompts of --input-len random token ids, each generating exactly --output-len
tokens (temperature 1, ignore_eos), --num-iters-warmup untimed runs, then --num-iters timed ones.
Prefix caching is off by default (every iteration repeats the same prompts), as in vLLM.
Writes vLLM's keys: avg_latency, std_latency, latencies, percentiles (10/25/50/75/90/99), seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from jaxlm.engine.arg_utils import EngineArgs

    g = parser.add_argument_group("latency", "vLLM's flags")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="output tokens")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per iteration")
    g.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first")
    g.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    g.add_argument("--output-json", default=None, help="write the results here")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(enable_prefix_caching=False)


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from jaxlm import LLM, SamplingParams
    from jaxlm.benchmarks.offline import engine_kwargs

    if min(args.input_len, args.output_len, args.batch_size, args.num_iters) < 1 or args.num_iters_warmup < 0:
        print("jaxlm bench latency: --input-len, --output-len, --batch-size and --num-iters must be positive")
        return 1
    llm = LLM(**engine_kwargs(args))
    max_len = llm.llm_engine.model_config.max_model_len
    if args.input_len + args.output_len > max_len:
        print(f"jaxlm bench latency: --input-len + --output-len ({args.input_len + args.output_len}) is more than "
              f"max_model_len {max_len}")
        return 1
    vocab = int(llm.llm_engine.model_config.hf_config.vocab_size)
    rng = np.random.default_rng(args.seed)
    prompts = [{"prompt_token_ids": ids} for ids in rng.integers(0, min(10000, vocab), (args.batch_size, args.input_len)).tolist()]
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    def once() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        once()
    latencies = np.array([once() for _ in tqdm(range(args.num_iters), desc="Bench iterations",
                                                 disable=args.disable_tqdm)])
    pcts = np.percentile(latencies, PERCENTAGES)
    print(f"Avg latency: {latencies.mean()} seconds")
    print(f"Std latency: {latencies.std()} seconds")
    for p, v in zip(PERCENTAGES, pcts):
        print(f"{p}% percentile latency: {v} seconds")
    if args.output_json:
        res = {"avg_latency": float(latencies.mean()), "std_latency": float(latencies.std()),
               "latencies": latencies.tolist(), "percentiles": {str(p): float(v) for p, v in zip(PERCENTAGES, pcts)}}
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=4)
    return 0
