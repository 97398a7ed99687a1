"""Mixture-of-experts figures (scripts/bench.py --moe).

A synthetic Qwen3-MoE (hidden 512, 4 layers, top-2, random weights built with transformers):

1. Cost follows active parameters: the decode step at batch 64 with 64 experts against 8 experts
   of the same size, the two engines in one process, timed in alternating rounds.
2. The expert MLP alone at the same shape (128 rows = 64 tokens x top-2): the grouped MLP the
   engine runs against every expert computed on every token (what XLA:CPU's ragged_dot lowering
   does), so the gap to "about 8x" is visible.
3. Memory: the bytes device 0 holds at EP=4, TP=4 without EP and one device (a subprocess with
   8 host devices), split into experts and the rest (attention, embeddings, norms).

bench.py then runs its usual engine benchmark on the 64-expert checkpoint (and transformers on
the same weights with --vs-hf).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout (tests.helpers)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def make_checkpoint(workdir: str, num_experts: int, expert_size: int, vocab: int) -> str:
    from tests.helpers.tiny_models import make_tiny_model

    path = os.path.join(workdir, f"moe_e{num_experts}_i{expert_size}_v{vocab}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_model("qwen3_moe", path, vocab_size=vocab, hidden_size=512, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1536,
                        num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=expert_size,
                        mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=4096)
    return path


def decode_steps(paths: dict[str, str], batch: int = 64, prompt: int = 16, rounds: int = 7,
                 steps: int = 8) -> dict[str, list[float]]:
    """Seconds per decode step of each engine (all ``batch`` requests decoding), in rounds that
    alternate between the engines so the host's drift hits them alike."""
    import numpy as np

    from jaxlm import LLM, SamplingParams

    engines = {}
    for name, path in paths.items():
        llm = LLM(model=path, max_num_seqs=batch, max_model_len=prompt + rounds * steps + 64,
                  max_num_batched_tokens=max(512, batch * prompt), token_buckets=[batch, batch * prompt],
                  seq_buckets=[batch], async_scheduling=False)
        eng = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=rounds * steps + 32, ignore_eos=True)
        rng = np.random.default_rng(0)
        for i in range(batch):
            eng.add_request(f"r{i}", {"prompt_token_ids": rng.integers(3, 250, prompt).tolist()}, params)
        for _ in range(3):  # one prefill step (the budget holds every prompt), then all decoding
            eng.step()
        engines[name] = (llm, eng)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, (_, eng) in engines.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            times[name].append((time.perf_counter() - t0) / steps)
    for name, (_, eng) in engines.items():
        assert eng.get_model_runner().num_compiles_after_warmup == 0, name
    return times


def expert_mlp_ms(expert_size: int, rows: int = 128, hidden: int = 512, rounds: int = 9) -> dict[str, float]:
    """Median ms of one layer's expert MLP over ``rows`` sorted rows: the engine's grouped MLP,
    and every expert on every row (ragged_dot as XLA:CPU lowers it), at 8 and 64 experts."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlm.models.moe_ops import grouped_mlp, grouped_mlp_ragged

    rng = np.random.default_rng(0)
    fns, args = {}, {}
    for E in (8, 64):
        w_gu = jnp.asarray(0.05 * rng.normal(size=(E, hidden, 2, expert_size)), jnp.float32)
        w_d = jnp.asarray(0.05 * rng.normal(size=(E, expert_size, hidden)), jnp.float32)
        xs = jnp.asarray(rng.normal(size=(rows, hidden)), jnp.float32)
        es = jnp.asarray(np.sort(rng.integers(0, E, rows)), jnp.int32)
        for name, impl in (("grouped", grouped_mlp), ("every expert", grouped_mlp_ragged)):
            fns[(name, E)] = jax.jit(functools.partial(impl, act=jax.nn.silu))
            args[(name, E)] = (xs, es, w_gu, w_d, jnp.int32(0))
            fns[(name, E)](*args[(name, E)]).block_until_ready()
    out: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f(*args[k]).block_until_ready()
            out[k].append(time.perf_counter() - t0)
    return {f"{name} E={E}": 1e3 * statistics.median(v) for (name, E), v in out.items()}


def device_bytes(path: str) -> dict:
    """Per-device bytes at EP=4 / TP=4 / one device, from a subprocess with 8 host devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--device-bytes", path], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _device_bytes_child(path: str) -> None:
    import jax
    from flax import nnx

    from jaxlm import LLM

    dev = jax.devices()[0]
    out = {}
    for name, tp, ep in (("EP=4", 4, True), ("TP=4", 4, False), ("1 device", 1, False)):
        llm = LLM(model=path, tensor_parallel_size=tp, enable_expert_parallel=ep, max_num_seqs=4, max_model_len=64,
                  max_num_batched_tokens=64, token_buckets=[64], seq_buckets=[4], num_gpu_blocks_override=16)
        runner = llm.llm_engine.get_model_runner()
        parts = {"experts": 0, "attention": 0, "embeddings+head": 0, "other": 0}
        for p, v in nnx.to_flat_state(runner.params):
            key = ("experts" if "experts" in p else "attention" if "self_attn" in p
                   else "embeddings+head" if ("embed" in str(p) or "lm_head" in p) else "other")
            parts[key] += sum(s.data.nbytes for s in v.get_value().addressable_shards if s.device == dev)
        out[name] = parts
        del llm
    print(json.dumps(out))


def run(args) -> str:
    """Print the MoE figures; returns the 64-expert checkpoint for bench.py's engine run."""
    os.makedirs(args.workdir, exist_ok=True)
    size, vocab = args.moe_expert_size, args.moe_vocab
    paths = {f"{e} experts": make_checkpoint(args.workdir, e, size, vocab) for e in (8, 64)}
    load = os.getloadavg()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"MoE: hidden 512, 4 layers, top-2, expert size {size}, vocab {vocab}; {cpu}, load {load[0]:.2f}",
          flush=True)
    mlp = expert_mlp_ms(size)
    print("one layer's expert MLP, 128 rows (64 tokens x top-2), ms: "
          + ", ".join(f"{k} {v:.2f}" for k, v in mlp.items()))
    print(f"  grouped 64 vs 8 experts: {mlp['grouped E=64'] / mlp['grouped E=8']:.2f}x; every expert on every "
          f"row at 64: {mlp['every expert E=64'] / mlp['grouped E=8']:.1f}x the grouped 8", flush=True)
    times = decode_steps(paths)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("batch-64 decode step, median of rounds: "
          + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in med.items())
          + f"; 64 vs 8 experts: {med['64 experts'] / med['8 experts']:.2f}x (target <= 1.3x)", flush=True)
    mem = device_bytes(paths["64 experts"])
    for name, parts in mem.items():
        print(f"  {name}: device 0 holds " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items())
              + f" (total {sum(parts.values()) / 2**20:.1f} MiB)")
    return paths["64 experts"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--device-bytes"]:
        _device_bytes_child(sys.argv[2])
