"""Rank 0 of a two-node run on localhost, as a process of tests/executor/test_multihost_executor.py.

Usage: ``python -m tests.helpers.multihost_cases MODEL MASTER_PORT DIR [--reference] [--idle]``, or
``... --bench`` / ``... --bench-single TP`` for the step-time figures. The
follower is ``python -m jaxlm.serve MODEL --headless --nnodes 2 --node-rank 1 ...`` (started by
the test). This process serves through AsyncLLMEngine (TP=2 over the two processes' CPU
devices), writes DIR/results.json (greedy tokens, compile counter, mean step time; with
--reference also the tokens of a one-device engine in this process), then keeps generating
until the engine dies, and writes DIR/error.json (the exception open requests got); with
--idle it waits without requests instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time

from jaxlm import LLM, SamplingParams
from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.structured_output.params import StructuredOutputsParams

ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, token_buckets=[16, 64],
              seq_buckets=[4], enable_prefix_caching=False)
PROMPTS = [[1] + [3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((40, 9, 23, 5))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
# Each node fills the same grammar bitmask (the follower builds its own matchers).
CONSTRAINED = SamplingParams(max_tokens=12, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(regex="(ab|ba)+c"))
PARAMS = [GREEDY, GREEDY, CONSTRAINED, GREEDY]
ENDLESS = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


async def collect(engine: AsyncLLMEngine, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate({"prompt_token_ids": prompt}, params, rid):
        tokens = list(out.outputs[0].token_ids)
    return tokens


async def serve(engine: AsyncLLMEngine, work: str, reference: bool) -> None:
    start = time.perf_counter()
    tokens = await asyncio.gather(*(collect(engine, p, params, f"g{i}")
                                    for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))))
    seconds = time.perf_counter() - start
    runner = engine.engine.get_model_runner()
    results = dict(tokens=tokens, compiles=runner.num_compiles_after_warmup, seconds=seconds)
    if reference:  # one device of this process, no collectives
        llm = LLM(model=sys.argv[1], **ENGINE)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        results["reference"] = [list(o.outputs[0].token_ids) for o in outs]
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(results, f)
    if "--idle" in sys.argv:  # no step runs when the follower is lost: the process must exit
        await asyncio.sleep(3600)
    try:
        for i in range(10**6):  # until the test kills the follower
            await collect(engine, PROMPTS[i % 4], ENDLESS, f"e{i}")
    except Exception as e:  # noqa: BLE001 - what an open request gets is the result
        with open(os.path.join(work, "error.json"), "w") as f:
            json.dump(dict(type=type(e).__name__, message=str(e), time=time.time()), f)


def step_seconds(llm: LLM, num_steps: int = 40) -> float:
    """Median wall time of a decode step of 4 requests (the figures of the report)."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return sorted(times[4:num_steps])[len(times[4:num_steps]) // 2]


def bench(model: str, work: str, **parallel: int) -> None:
    """``--bench``: 2 nodes (PORT given, a follower started beside); ``--bench-single TP``: one
    process (XLA_FLAGS may give it 8 CPU devices)."""
    llm = LLM(model=model, **ENGINE, **parallel)
    with open(os.path.join(work, "bench.json"), "w") as f:
        json.dump(dict(parallel, step_seconds=step_seconds(llm)), f)
    llm.llm_engine.executor.shutdown()  # the follower leaves with exit code 0


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, port, work = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if "--bench" in sys.argv:
        return bench(model, work, tensor_parallel_size=2, nnodes=2, master_port=port)
    if "--bench-single" in sys.argv:
        return bench(model, work, tensor_parallel_size=int(sys.argv[sys.argv.index("--bench-single") + 1]))
    args = EngineArgs(model=model, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port,
                      distributed_timeout_seconds=5, **ENGINE)
    engine = AsyncLLMEngine.from_engine_args(args)
    asyncio.run(serve(engine, work, "--reference" in sys.argv))
    os._exit(3)  # the engine is dead: skip jax.distributed's exit barrier with the lost node


if __name__ == "__main__":
    main()
