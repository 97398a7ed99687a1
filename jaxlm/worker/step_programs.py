"""What the runner's compiled step programs share: the body's static kinds, unpacking the packed
step inputs inside a program, gathering vocab-split logits and the attention kernels' shape
rules (the compile guard is worker/compile_guard.py)."""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx

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
