"""The runner's compiled step programs: the body and the sampler as traced functions, and what
they share: the body's static kinds, unpacking the packed step inputs inside a program, gathering
vocab-split logits and the attention kernels' shape rules (the compile guard is
worker/compile_guard.py)."""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.attention.kv_quant import kv_scales_after_step
from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.lora.layers import set_lora_step
from jaxlm.sample.metadata import unpack_metadata
from jaxlm.sample.sampler import compute_prompt_logprobs

# Static kinds of the body program (see the module docstring).
MIXED, DECODE, PROMPT_LOGPROBS = "mixed", "decode", "prompt_logprobs"
# The attention metadata's fields among the body's packed inputs (input_batch.STEP_FIELDS).
# prev_idx: per token, the row of the previous step's sampled tokens (device-resident) that is
# its input id, or -1 (async scheduling: that token is not on the host yet).
MD_FIELDS = ("positions", "slot_mapping", "token_to_req", "block_tables", "seq_lens",
             "context_lens", "query_start_loc")


def load_order(table: str, key: tuple) -> tuple:
    """The order a deferred warm start loads programs in (program_cache.DeferredLoads): by
    bucket size, so the small steps of a first request come first; prompt logprobs last."""
    size, kind = key
    return (kind == PROMPT_LOGPROBS, size, table != "body", str(kind))


def unpack(flat: jax.Array, shapes: dict[str, tuple[int, ...]]) -> dict[str, jax.Array]:
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].reshape(shape)
        offset += n
    return out


def abstract(tree: Any) -> Any:
    """The tree's arrays as ShapeDtypeStructs (shape, dtype, sharding): what programs are lowered for."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def gathered(logits: jax.Array, replicated: jax.sharding.NamedSharding | None) -> jax.Array:
    """Vocab-split logits gathered onto every device (None: one device, as is), so the sampler
    sees the whole vocabulary as on one device and picks the same tokens."""
    return logits if replicated is None else jax.lax.with_sharding_constraint(logits, replicated)


def kernel_constraints(model: nnx.Module, block_size: int, head_dim: int) -> Any:
    """The attention kernels' shape rules (PallasConstraints) for this cache, or None when the
    model's backend runs no kernels for it (XLA, or a geometry the kernels don't support)."""
    backend = getattr(model, "attn_backend", None)  # what the model's attention layers call
    c = backend.constraints(block_size, head_dim) if backend is not None else None
    return c if c is not None and c.supported else None


def leaves_read(fn: Any, leaves: list[Any], *args: Any) -> list[int]:
    """Indices of the `leaves` that fn(leaves, *args) reads (traced once, abstract values): a
    compiled program's call costs per argument, so the sampler is handed only the parameters
    its logits need (the LM head or the tied embedding), not the whole model."""
    jaxpr = jax.make_jaxpr(fn)(leaves, *args).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [i for i, v in enumerate(jaxpr.invars[:len(leaves)]) if id(v) in read]


def with_unread(read: list[Any], index: list[int], like: list[Any]) -> list[Any]:
    """Inside a program: the full leaf list from the leaves it was handed (`read`, at `index`);
    the others are zeros nothing reads (XLA drops them)."""
    full = [jax.numpy.zeros(x.shape, x.dtype) for x in like]
    for i, leaf in zip(index, read):
        full[i] = leaf
    return full


def body_program(runner: Any, T: int, kind: str) -> Callable:
    """The body for token bucket T of `kind`: (leaves, kv_caches, packed, prev_tokens[, mm rows])
    -> (the sampling rows' hidden states[, prompt logprobs][, K/V scales], kv_caches)."""
    graphdef, k, replicated = runner.graphdef, runner.sampling.max_logprobs, runner._replicated
    shapes, treedef, scale_index = runner._step_shapes(T, kind), runner._param_treedef, runner._kv_scale_index

    def body(leaves, kv_caches, packed, prev_tokens, *mm_embeds):
        params = jax.tree.unflatten(treedef, leaves)
        x = unpack(packed, shapes)
        idx = x["prev_idx"]
        x["input_ids"] = jnp.where(idx >= 0, prev_tokens[jnp.maximum(idx, 0)], x["input_ids"])
        # max_query_len is static: a kernel backend traces its decode kernel for DECODE.
        md = AttentionMetadata(**{f: x[f] for f in MD_FIELDS}, max_query_len=1 if kind == DECODE else None)
        model = nnx.merge(graphdef, params)
        if "lora_slots" in x:
            set_lora_step(model, x["lora_slots"])
        # A multimodal model's image rows, merged at its placeholder tokens (mm_mask).
        mm = {"mm_embeds": mm_embeds[0], "mm_mask": x["mm_mask"]} if mm_embeds else {}
        if "mrope_positions" in x:  # Qwen2.5-VL: the rope's [3, T] positions
            mm["mrope_positions"] = x["mrope_positions"]
        hidden, kv_caches = model(x["input_ids"], md.positions, kv_caches, md, **mm)
        selected = hidden[x["logits_indices"]]
        if replicated is not None:
            selected = jax.lax.with_sharding_constraint(selected, replicated)
        # The K/V scales the step used (computed by the first one): (scales,) or ().
        scales = (kv_scales_after_step(model, scale_index, replicated),) if scale_index else ()
        if kind != PROMPT_LOGPROBS:
            return selected, *scales, kv_caches
        logits = gathered(model.compute_logits(hidden), replicated)
        prompt_lps = compute_prompt_logprobs(logits, x["next_token_ids"], k)
        return selected, prompt_lps, *scales, kv_caches

    return body


def sample_program(runner: Any, num_rows: int, md: Any) -> Callable:
    """The sampler over the first `num_rows` hidden rows for `md`'s layout and variant:
    (read leaves, hidden, packed metadata) -> (SamplerOutput, tokens padded to the capacity)."""
    merge, replicated, treedef, sampler = (runner._merge_for_sampler, runner._replicated, runner._param_treedef,
                                           runner.sampler_fn)
    layout, static = md.layout(), (md.variant, md.max_logprobs, md.num_candidates)
    pad = runner.sample_capacity - num_rows
    index, like = runner._sampler_leaf_index, runner._param_leaves

    def logits_and_sample(read_leaves, hidden, packed_md):
        sampling_md = unpack_metadata(packed_md, layout, *static)
        model = merge(jax.tree.unflatten(treedef, with_unread(read_leaves, index, like)))
        logits = model.compute_logits(hidden[:num_rows])
        out = sampler(gathered(logits, replicated), sampling_md)
        # The next step's decode rows read their input ids from here (async scheduling).
        tokens = jnp.pad(out.sampled_token_ids, (0, pad))
        if replicated is not None:
            tokens = jax.lax.with_sharding_constraint(tokens, replicated)
        return out, tokens

    return logits_and_sample
