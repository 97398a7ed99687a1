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


def unpack(flat: jax.Array, shapes: dict[str, tuple[int, ...]]) -> dict[str, jax.Array]:
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].reshape(shape)
        offset += n
    return out


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
