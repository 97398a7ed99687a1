"""Step time under pipeline parallel vs one device, on 8 CPU host devices (a sanity check).

The host devices share this machine's cores: the figures only show that the stages overlap.

    python scripts/bench_pipeline.py [--pp 1 2] [--layers 8] [--hidden 256]

A random Llama (no download) serves 8 prompts of 49 tokens, 32 greedy tokens each, prefix
caching off; token buckets 200 and 400, so one step of 392 tokens and two micro-batches of 196
pad alike. Prints the median prefill step (all 8 prompts in one step) and decode step (8 rows),
over 5 runs, per pipeline size, and for PP > 1 also with a single micro-batch (no stage overlap).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxlm import LLM, SamplingParams  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402


def step_times(llm: LLM, prompts: list[list[int]]) -> dict[str, list[float]]:
    executor = llm.llm_engine.executor
    execute = executor.execute_model
    times: dict[str, list[float]] = {"prefill": [], "decode": []}

    def timed(so):
        start = time.perf_counter()
        out = execute(so)
        decode = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)
        times["decode" if decode else "prefill"].append(time.perf_counter() - start)
        return out

    executor.execute_model = timed
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    executor.execute_model = execute
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    path = tm.make_tiny_model("llama", os.path.join(tempfile.mkdtemp(), "llama"), num_hidden_layers=args.layers,
                              hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_attention_heads=8,
                              num_key_value_heads=4)
    prompts = [[1] + [3 + (7 * i + j) % 250 for j in range(48)] for i in range(8)]
    for pp in args.pp:
        llm = LLM(model=path, pipeline_parallel_size=pp, max_num_seqs=8, max_model_len=128,
                  max_num_batched_tokens=512, token_buckets=[8, 16, 200, 400, 512], seq_buckets=[8],
                  enable_prefix_caching=False)
        runner = llm.llm_engine.get_model_runner()
        step_times(llm, prompts)  # first pass: warm caches and allocator
        runs = [("", None)] + ([(" (1 micro-batch)", 1)] if pp > 1 else [])
        for label, micro in runs:
            if micro is not None:
                runner.num_micro_batches = micro
            t = {"prefill": [], "decode": []}
            for _ in range(5):
                for kind, times in step_times(llm, prompts).items():
                    t[kind] += times
            print(f"PP={pp}{label}: prefill step median {1e3 * statistics.median(t['prefill']):.1f} ms, "
                  f"decode step median {1e3 * statistics.median(t['decode']):.2f} ms "
                  f"({len(t['prefill'])} + {len(t['decode'])} steps)")
        del llm


if __name__ == "__main__":
    main()
