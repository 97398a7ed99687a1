"""Speculative decoding under tensor parallel, on 8 CPU devices (a subprocess of
tests/spec_decode/test_spec_tp.py): a TP=2 target with its draft at draft_tensor_parallel_size=1
(on the first device) and at 2 (the target's mesh). Usage:
``python -m tests.helpers.spec_mesh_cases OUT.json DIR``; writes each engine's greedy tokens,
its compile counter after warm-up, its spec-decode counters and where the draft's weights live.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

from jaxlm import LLM, SamplingParams  # noqa: E402
from tests.helpers.tiny_models import make_tiny_engine_model  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, token_buckets=[32],
              seq_buckets=[16], tensor_parallel_size=2, seed=0)
PROMPTS = [[1] + [3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((40, 9, 23))]


def run(path: str, draft_tp: int) -> dict:
    llm = LLM(model=path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                              "draft_tensor_parallel_size": draft_tp}, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.get_model_runner()
    stats = llm.llm_engine.get_stats()["spec_decoding"]
    draft_devices = {d.id for leaf in jax.tree.leaves(runner.drafter.params) for d in leaf.devices()}
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs], compiles=runner.num_compiles_after_warmup,
                drafted=stats.num_draft_tokens, accepted=stats.num_accepted_tokens,
                draft_devices=sorted(draft_devices))


def main(out_path: str, work_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    path = make_tiny_engine_model("llama", os.path.join(work_dir, "llama"))
    results = {"prompts": PROMPTS, "path": path, **{f"draft_tp{tp}": run(path, tp) for tp in (1, 2)}}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
