"""Decode tok/s with a float32 KV cache against an fp8 one, side by side in one process.

A SmolLM2-135M-shaped Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64,
intermediate 1536, vocab 49152, tied embeddings), random weights, float32, loaded by jaxlm's
loader once per KV dtype (that dtype's attention backend and scales). The timed step is what a
decode step's programs run: the model over --batch tokens (one per request, each at its own
position around --context) writing and reading the paged cache (donated, as in the engine), then
the logits and their argmax. The caches are filled with random K/V first (the step reads every
context key either way). Rounds alternate A and B, --steps steps each; medians over all rounds.

    python scripts/dev/bench_kv_dtype.py --batch 32 --context 1024 --rounds 7 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def make_model(path: str) -> str:
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_step(path: str, kv_cache_dtype: str, backend_name: str, batch: int, context: int, block_size: int):
    """(step function, its state) for one KV dtype: state = (kv caches, positions)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxlm.attention.backends import get_attention_backend
    from jaxlm.attention.kv_quant import kv_quant_for, quantize_fp8, resolve_kv_cache_dtype
    from jaxlm.attention.metadata import AttentionMetadata
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import get_model

    backend = get_attention_backend(backend_name, kv_quant=kv_quant_for(kv_cache_dtype, False))
    model = get_model(ModelConfig(model=path), LoadConfig(), attn_backend=backend)
    spec = type(model).kv_cache_spec(model.args)
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, jnp.float32)
    pages = -(-(context + 64) // block_size)
    num_blocks = batch * pages + 1
    rng = np.random.default_rng(0)
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    caches = []
    for _ in range(spec.num_layers):
        x = jnp.asarray(rng.standard_normal(shape, np.float32))
        # As the engine keeps them: an fp8 cache as its bytes (kv_quant.storage_dtype).
        caches.append(jax.lax.bitcast_convert_type(quantize_fp8(x, 1.0, dtype), jnp.uint8)
                      if jnp.dtype(dtype).itemsize == 1 else x.astype(dtype))
    tables = jnp.asarray(1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages))
    graphdef, params = nnx.split(model)

    def step(params, caches, tokens, positions):
        model = nnx.merge(graphdef, params)
        slots = tables[jnp.arange(batch), positions // block_size] * block_size + positions % block_size
        md = AttentionMetadata(positions=positions, slot_mapping=slots, token_to_req=jnp.arange(batch, dtype=jnp.int32),
                               block_tables=tables, seq_lens=positions + 1, context_lens=positions,
                               query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32), max_query_len=1)
        hidden, caches = model(tokens, positions, caches, md)
        return jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32), caches

    step = jax.jit(step, donate_argnums=(1,))
    return step, params, caches, tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024, help="keys each request's first timed step reads")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="decode steps per engine per round")
    ap.add_argument("--dtypes", default="auto,fp8", help="the two --kv-cache-dtype values (A,B)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "jaxlm_bench_smollm2_shape"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlm.attention.backends import resolve_backend_name

    path = make_model(args.model_dir)
    print(f"backend {resolve_backend_name(args.attention_backend)}; batch {args.batch}, context {args.context}",
          flush=True)
    runs = {}
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        step, params, caches, _ = build_step(path, dtype, args.attention_backend, args.batch, args.context, 16)
        tokens = jnp.asarray(np.arange(args.batch, dtype=np.int32) + 5)
        positions = jnp.full((args.batch,), args.context, jnp.int32)
        tokens, caches = step(params, caches, tokens, positions)  # compile + one untimed step
        jax.block_until_ready(tokens)
        runs[dtype] = dict(step=step, params=params, caches=caches, tokens=tokens, positions=positions + 1)
        print(f"{dtype}: ready in {time.perf_counter() - t0:.0f} s (cache {caches[0].dtype}, "
              f"{sum(c.nbytes for c in caches) / 2**30:.2f} GiB)", flush=True)
    times: dict[str, list[float]] = {d: [] for d in runs}
    for r in range(args.rounds):
        for dtype, run in runs.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                run["tokens"], run["caches"] = run["step"](run["params"], run["caches"], run["tokens"], run["positions"])
                jax.block_until_ready(run["tokens"])
                times[dtype].append(time.perf_counter() - t)
                run["positions"] = run["positions"] + 1
        print(f"round {r}: " + ", ".join(f"{d} {statistics.median(ts[-args.steps:]) * 1e3:.0f} ms"
                                         for d, ts in times.items()), flush=True)
    med = {d: statistics.median(ts) for d, ts in times.items()}
    for d, m in med.items():
        print(f"{d}: median decode step {m * 1e3:.1f} ms = {args.batch / m:.1f} tok/s")
    a, b = list(med)
    print(f"{b} / {a}: {med[a] / med[b]:.2f}x tok/s")


if __name__ == "__main__":
    main()
