"""Scheduler cost per step against the number of waiting requests, fcfs vs priority.

The core alone (no model, no jax): N requests wait (random priorities, 3-token prompts, 2 output
tokens each); a stand-in runner samples token 7 for every request that reached its last token.
Prints microseconds per schedule() + update_from_output() over the first steps. The priority
queue is a heap, so admission stays O(log N): its step cost should barely move with N.

    python scripts/bench_scheduler_queue.py --waiting 1000 100000
"""

from __future__ import annotations

import argparse
import random
import time

from jaxlm.config import CacheConfig, SchedulerConfig
from jaxlm.core.outputs import ModelRunnerOutput
from jaxlm.core.request import Request
from jaxlm.core.scheduler import Scheduler
from jaxlm.sampling_params import SamplingParams


def _runner_output(scheduler: Scheduler, so) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        r = scheduler.requests[rid]
        done = r.num_computed_tokens + so.num_scheduled_tokens[rid] >= r.num_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput.from_lists(req_ids, sampled)


def step_cost_us(policy: str, num_waiting: int, steps: int) -> float:
    rng = random.Random(0)
    cache = CacheConfig(block_size=16)
    cache.num_gpu_blocks = 4096
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                      scheduling_policy=policy), cache)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i in range(num_waiting):
        sched.add_request(Request(f"r{i}", [100 + i % 50, 7, 8], params, arrival_time=float(i),
                                  priority=rng.randrange(100) if policy == "priority" else 0))
    start = time.perf_counter()
    for _ in range(steps):
        so = sched.schedule()
        sched.update_from_output(so, _runner_output(sched, so))
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waiting", type=int, nargs="+", default=[1000, 100000])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for n in args.waiting:
        for policy in ("fcfs", "priority"):
            print(f"waiting={n:>7} {policy:>8}: {step_cost_us(policy, n, args.steps):8.1f} us/step")


if __name__ == "__main__":
    main()
