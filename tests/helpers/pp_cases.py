"""Pipeline-parallel cases run on 8 CPU devices, in a subprocess of tests/executor/test_pipeline_parallel.py.

As tests/helpers/mesh_cases.py (its prompts and engine settings, one token bucket: chunked prefill, preemption):
XLA_FLAGS must give 8 host devices before jax is imported. Usage:
``python -m tests.helpers.pp_cases OUT.json DIR``. Writes, per case "family/tpxpp": tokens and
top logprobs, the compile counter after warm-up, the layers and bytes each stage's devices
hold, every step's (stage, micro-batch) dispatch order, the step time; plus the errors.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxlm import LLM, SamplingParams  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402
from tests.helpers.mesh_cases import ENGINE as TP_ENGINE, GREEDY, PROMPTS, SEEDED  # noqa: E402

ENGINE = {**TP_ENGINE, "token_buckets": [32]}

# family -> (tiny config overrides, [(tp, pp)]). Llama: 4 layers split 2/2 and 1/1/1/1, and
# TP=2 x PP=2. Qwen2: 3 layers split 2/1 (uneven: the first stage one more) under TP=2 x PP=2,
# tied embedding (the last stage holds its own copy as the LM head). One token bucket keeps the
# programs few (the samplers' 6 per engine dominate).
CASES = {
    "llama": ({"num_hidden_layers": 4}, [(1, 1), (1, 2), (1, 4), (2, 2)]),
    "qwen2": ({"num_hidden_layers": 3, "tie_word_embeddings": True}, [(1, 1), (2, 2)]),
}


def device_bytes(arrays, device) -> int:
    return sum(s.data.nbytes for a in jax.tree.leaves(arrays) for s in a.addressable_shards if s.device == device)


def stage_layout(runner) -> list[dict]:
    """Per stage: the layer indices its params hold, and its first device's weight/KV bytes."""
    layout = []
    for mesh, params in zip(runner.stage_meshes, runner.stage_params):
        layers = sorted({int(path[path.index("layers") + 1]) for path, _ in nnx.to_flat_state(params)
                         if "layers" in path})
        devices = {d.id for a in jax.tree.leaves(params) for d in a.devices()}
        dev = mesh.devices.flat[0]
        layout.append(dict(layers=layers, devices=sorted(devices), mesh_devices=sorted(d.id for d in mesh.devices.flat),
                           weight_bytes=device_bytes(params, dev), kv_bytes=device_bytes(runner.kv_caches, dev)))
    return layout


def run_case(path: str, tp: int, pp: int) -> dict:
    llm = LLM(model=path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    runner = llm.llm_engine.get_model_runner()
    schedules: list = []
    if pp > 1:  # keep every step's dispatch order, not only the last one's
        run_body = runner._run_body

        def recording(so):
            out = run_body(so)
            schedules.append(list(runner.last_schedule))
            return out

        runner._run_body = recording
    params = [GREEDY, GREEDY, SEEDED, GREEDY]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    # Prompt logprobs: a step owing them runs as one micro-batch, beside a decoding request.
    scored = llm.generate([{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[3]}],
                          [GREEDY, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)], use_tqdm=False)
    prompt_logprobs = [None if p is None else {str(k): v.logprob for k, v in p.items()}
                       for p in scored[1].prompt_logprobs]
    dev0 = jax.devices()[0]
    result = dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        logprobs=[[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outs],
        prompt_logprobs=prompt_logprobs, compiles=runner.num_compiles_after_warmup,
        kv_shards=runner.kv_cache_shards(), programs=runner.num_programs, seconds=seconds,
        preemptions=llm.llm_engine.scheduler.num_preemptions, schedules=schedules,
        stages=stage_layout(runner) if pp > 1 else [],
        weight_bytes=device_bytes(runner.params, dev0), kv_bytes=device_bytes(runner.kv_caches, dev0),
        layer_weight_bytes=sum(v.get_value().nbytes for path, v in nnx.to_flat_state(runner.params)
                               if "layers" in path))
    del llm
    return result


def orbax_layout(path: str, work_dir: str) -> dict[str, list[int]]:
    """An orbax checkpoint loaded onto a PP=2 mesh: the devices holding each Param (by nnx path)."""
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.executor.mesh_executor import make_mesh
    from jaxlm.model_loader import get_model, resolve_model_config, save_orbax

    load = LoadConfig()
    mc = resolve_model_config(ModelConfig(model=path), load)
    out = os.path.join(work_dir, "orbax")
    save_orbax(get_model(mc, load, attn_backend=None), out, mc.hf_config)
    orbax = LoadConfig(load_format="orbax")
    model = get_model(resolve_model_config(ModelConfig(model=out), orbax), orbax, attn_backend=None,
                      mesh=make_mesh(1, pp=2))
    return {".".join(map(str, p)): sorted(d.id for d in v.get_value().devices())
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def error_of(path: str, tp: int, pp: int) -> str:
    try:
        LLM(model=path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    except ValueError as e:
        return str(e)
    return ""


def main(out_path: str, work_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    results: dict = {}
    paths = {}
    for name, (overrides, sizes) in CASES.items():
        paths[name] = tm.make_tiny_model(name, os.path.join(work_dir, name), **overrides)
        for tp, pp in sizes:
            results[f"{name}/{tp}x{pp}"] = run_case(paths[name], tp, pp)
    results["orbax_layout"] = orbax_layout(paths["llama"], work_dir)
    results["errors"] = dict(too_few_devices=error_of(paths["llama"], 2, 8),
                             too_few_layers=error_of(paths["llama"], 1, 8))
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
