"""LoRA figures (``python scripts/bench.py --lora-modules [NAME=PATH ...]``), side by side in one process.

* batch-64 decode step time: the base model, LoRA enabled with no adapter in the batch, and
  four different adapters in the batch (16 requests each), engines interleaved round by round;
* loading a new adapter at run time (into a slot, evicting one): its time and the compiles it
  caused (must be 0);
* ``--delta``: the ways of computing the delta inside a linear layer (jaxlm/lora/layers.py),
  at the model's layer shapes.

Without paths, four random adapters of rank 16 over every adaptable layer (q/k/v/o/gate/up/down)
are written for the model (``--lora-rank``).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np


def write_random_adapters(model: str | None, out_dir: str, num: int, rank: int, seed: int = 0) -> list[tuple[str, str]]:
    """``num`` PEFT directories with random A and B (non-zero) over every adaptable layer."""
    from safetensors.numpy import save_file

    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.lora.targets import lora_targets
    from jaxlm.model_loader import resolve_model_config
    from jaxlm.model_loader.loader import init_abstract_model

    mc = resolve_model_config(ModelConfig(model=model), LoadConfig())
    targets = lora_targets(init_abstract_model(mc, attn_backend=None))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        path = os.path.join(out_dir, f"adapter{i}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for t in targets.modules.values():
            key = f"base_model.model.{t.path}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, t.in_features)) / t.in_features ** 0.5).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((t.out_features, rank))).astype(np.float32)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        names = sorted({p.rsplit(".", 1)[-1] for p in targets.modules})
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": names}, f)
        out.append((f"adapter{i}", path))
    return out


def _fill(llm, loras: list, batch: int, steps: int) -> None:
    """``batch`` requests (adapters round robin), prefilled: the next ``steps`` steps are decode-only."""
    from jaxlm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{i}", {"prompt_token_ids": [1 + (i * 7 + j) % 200 for j in range(8)]}, params,
                           lora_request=loras[i % len(loras)])
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()


def _drain(llm) -> None:
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


def bench_lora(model: str | None, dtype: str, modules: list[tuple[str, str]], rank: int, rounds: int = 3,
               steps: int = 12, batch: int = 64, workdir: str = "/tmp/jaxlm_bench") -> dict:
    """Three engines (base; LoRA with base-model requests; LoRA with 4 adapters), each holding
    ``batch`` decoding requests; their steps alternate one by one, so drift hits all alike."""
    from jaxlm import LLM, LoRARequest

    if not modules:
        modules = write_random_adapters(model, os.path.join(workdir, "lora"), 5, rank)
    common = dict(model=model, dtype=dtype, max_num_seqs=batch, max_model_len=256, max_num_batched_tokens=512,
                  token_buckets=[batch, 512], seq_buckets=[batch], async_scheduling=False)
    with_lora = dict(common, enable_lora=True, max_loras=4, max_lora_rank=rank)
    requests = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(modules)]
    runs = {"base": (LLM(**common), [None]), "lora_enabled_no_adapter": (LLM(**with_lora), [None]),
            "lora_4_adapters": (LLM(**with_lora), requests[:4])}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for llm, loras in runs.values():
            _fill(llm, loras, batch, steps)
        for _ in range(steps):
            for name, (llm, _) in runs.items():
                t0 = time.perf_counter()
                llm.llm_engine.step()
                times[name].append(time.perf_counter() - t0)
        for llm, _ in runs.values():
            _drain(llm)
    out = {k: float(np.median(v)) for k, v in times.items()}
    lora = runs["lora_4_adapters"][0]
    runner = lora.llm_engine.get_model_runner()
    if len(requests) > 4:  # a fifth adapter evicts one: a run-time load
        compiles = runner.num_compiles_after_warmup
        _fill(lora, [requests[4]], 1, 1)
        _drain(lora)
        out["load_ms"] = 1e3 * runner.lora.last_load_seconds
        out["compiles_from_load"] = runner.num_compiles_after_warmup - compiles
    runners = {k: llm.llm_engine.get_model_runner() for k, (llm, _) in runs.items()}
    out["compiles_after_warmup"] = sum(r.num_compiles_after_warmup for r in runners.values())
    out["programs"] = {k: r.num_programs for k, r in runners.items()}
    out["warmup_s"] = {k: r.warmup_seconds for k, r in runners.items()}
    print(f"batch-{batch} decode step, median of {rounds} x {steps} steps, engines alternating step by step (ms): "
          + ", ".join(f"{k} {1e3 * out[k]:.1f}" for k in runs))
    print(f"  4 adapters / base: {out['lora_4_adapters'] / out['base']:.2f}x (target <= 1.3x); "
          f"enabled, none in batch / base: {out['lora_enabled_no_adapter'] / out['base']:.2f}x (target <= 1.05x)")
    if "load_ms" in out:
        print(f"  run-time adapter load into a slot: {out['load_ms']:.1f} ms, {out['compiles_from_load']} compiles")
    print(f"  programs: {out['programs']}; compiles after warm-up: {out['compiles_after_warmup']}; "
          f"warm-up s: {', '.join(f'{k} {v:.0f}' for k, v in out['warmup_s'].items())} "
          "(programs an engine before it compiled come from the compile cache)")
    return out


def bench_delta(T_list=(64, 512), slots: int = 4, rank: int = 16, layers: int = 6, reps: int = 9) -> None:
    """The delta's candidate forms at SmolLM2's layer shapes, against the base linears alone."""
    import jax
    import jax.numpy as jnp

    H, I = 576, 1536
    mods = [(H, H), (H, 192), (H, 192), (H, H), (H, I), (H, I), (I, H)]
    rng = np.random.default_rng(0)
    mk = lambda *s: jnp.asarray(0.02 * rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    P = {"W": [[mk(i, o) for i, o in mods] for _ in range(layers)],
         "A": [[mk(i, slots * rank) for i, _ in mods] for _ in range(layers)],
         "B": [[mk(slots * rank, o) for _, o in mods] for _ in range(layers)],
         "As": [[mk(slots + 1, i, rank) for i, _ in mods] for _ in range(layers)],
         "Bs": [[mk(slots + 1, rank, o) for _, o in mods] for _ in range(layers)]}

    def stack(linear):
        def f(P, x, *a):
            for l in range(layers):
                h = x
                for m, (i, o) in enumerate(mods):
                    xin = h if i == H else jnp.tile(h, (1, 3))[:, :I]
                    y = linear(P, l, m, xin, *a)
                    h = h + 0.01 * (y[:, :H] if o >= H else jnp.pad(y, ((0, 0), (0, H - o))))
                x = h
            return x
        return jax.jit(f)

    forms = {
        "base": stack(lambda P, l, m, x: x @ P["W"][l][m]),
        "masked (chosen)": stack(lambda P, l, m, x, mask: x @ P["W"][l][m] + ((x @ P["A"][l][m]) * mask) @ P["B"][l][m]),
        "gather per token": stack(lambda P, l, m, x, s: x @ P["W"][l][m] + jnp.einsum(
            "tr,tro->to", jnp.einsum("ti,tir->tr", x, P["As"][l][m][s]), P["Bs"][l][m][s])),
        "ragged_dot (sorted)": stack(lambda P, l, m, x, perm, inv, gs: x @ P["W"][l][m] + jax.lax.ragged_dot(
            jax.lax.ragged_dot(x[perm], P["As"][l][m][1:], gs), P["Bs"][l][m][1:], gs)[inv]),
        "matmul pair per slot": stack(lambda P, l, m, x, m4: x @ P["W"][l][m] + sum(
            ((x @ P["As"][l][m][s + 1]) * m4[:, s:s + 1]) @ P["Bs"][l][m][s + 1] for s in range(slots))),
    }
    for T in T_list:
        s = rng.integers(0, slots + 1, T).astype(np.int32)  # 0: no adapter
        onehot = (s[:, None] - 1 == np.arange(slots)[None]).astype(np.float32)
        perm = np.argsort(np.where(s == 0, slots + 1, s), kind="stable")
        args = {"base": (), "masked (chosen)": (jnp.asarray(np.repeat(onehot, rank, axis=1)),),
                "gather per token": (jnp.asarray(s),),
                "ragged_dot (sorted)": (jnp.asarray(perm), jnp.asarray(np.argsort(perm)),
                                        jnp.asarray(np.bincount(s, minlength=slots + 1)[1:].astype(np.int32))),
                "matmul pair per slot": (jnp.asarray(onehot),)}
        x = mk(T, H)
        for k, f in forms.items():
            f(P, x, *args[k]).block_until_ready()
        times = {k: [] for k in forms}
        for _ in range(reps):  # interleaved
            for k, f in forms.items():
                t0 = time.perf_counter()
                f(P, x, *args[k]).block_until_ready()
                times[k].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(f"{T} tokens, {layers} layers x 7 linears, {slots} slots of rank {rank}: " + ", ".join(
            f"{k} {1e3 * v:.1f} ms ({v / med['base']:.2f}x)" for k, v in med.items()), flush=True)
