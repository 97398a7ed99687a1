"""Quantized models under tensor parallel on 8 CPU devices, in a subprocess of
tests/models/quantization/test_quantized_tp.py (``python -m tests.helpers.quant_mesh_cases OUT.json DIR``).

Per case "name/tp": tokens and top logprobs of mesh_cases' prompts (chunked prefill, preemption),
device 0's weight bytes, the shard shapes of the q_proj (column-parallel) and o_proj
(row-parallel) scales on device 0, the compile counter after warm-up; plus the error for packed
int weights when tensor parallel repeats KV heads.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxlm import LLM  # noqa: E402
from tests.helpers import quant_checkpoints as qc  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402
from tests.helpers.mesh_cases import ENGINE as MESH_ENGINE, GREEDY, PROMPTS, SEEDED, per_device_bytes  # noqa: E402

# mesh_cases' engine (32-token budget: prompts chunked; 8 blocks: requests preempted) with one
# token bucket, so each engine compiles fewer programs.
ENGINE = {**MESH_ENGINE, "token_buckets": [32]}

# name -> (checkpoint format or "online", group size, tensor-parallel sizes). 4 heads, 2 KV
# heads: TP=4 repeats each KV head (and its per-channel scales) on two devices. Group 32 keeps
# whole groups on each device of a row-parallel layer at TP=2.
CASES = {
    "fp8-online": ("online", 0, (1, 4)),
    "ct-w4a16": ("ct-w4a16", 32, (1, 2)),
}


def _shard_shape(param) -> list[int]:
    dev = jax.devices()[0]
    return [list(s.data.shape) for s in param.get_value().addressable_shards if s.device == dev][0]


def run_case(path: str, tp: int, quantization: str | None) -> dict:
    llm = LLM(model=path, tensor_parallel_size=tp, quantization=quantization, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [GREEDY, GREEDY, SEEDED, GREEDY], use_tqdm=False)
    runner = llm.llm_engine.get_model_runner()
    attn = nnx.merge(runner.graphdef, runner.params).model.layers[0].self_attn
    scale = "weight_scale" if hasattr(attn.q_proj, "weight_scale") else "scales"
    result = dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        logprobs=[[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outs],
        weight_bytes=per_device_bytes(runner.params),
        q_scale=_shard_shape(getattr(attn.q_proj, scale)), o_scale=_shard_shape(getattr(attn.o_proj, scale)),
        compiles=runner.num_compiles_after_warmup, preemptions=llm.llm_engine.scheduler.num_preemptions)
    del llm
    return result


def main(out_path: str, work_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    base = tm.make_tiny_llama(os.path.join(work_dir, "float"), hidden_size=128, intermediate_size=256)
    results: dict = {}
    paths = {}
    for name, (fmt, group, tps) in CASES.items():
        if fmt == "online":
            paths[name] = base
        else:
            paths[name], _ = qc.write_quantized(base, fmt, os.path.join(work_dir, name),
                                                os.path.join(work_dir, name + "-ref"), group=group)
        for tp in tps:
            results[f"{name}/{tp}"] = run_case(paths[name], tp, "fp8" if fmt == "online" else None)
    try:
        LLM(model=paths["ct-w4a16"], tensor_parallel_size=4, **ENGINE)
        results["kv_repeat_error"] = ""
    except ValueError as e:
        results["kv_repeat_error"] = str(e)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
