"""What the runner's compiled step programs share: the body's static kinds, unpacking the packed
step inputs inside a program, gathering vocab-split logits, the attention kernels' shape rules,
and the compile guard (a listener counting XLA compiles while a step runs)."""

from __future__ import annotations

import logging
import math
import weakref
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

if TYPE_CHECKING:
    from jaxlm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Static kinds of the body program (see the module docstring).
MIXED, DECODE, PROMPT_LOGPROBS = "mixed", "decode", "prompt_logprobs"
# The attention metadata's fields among the body's packed inputs (input_batch.STEP_FIELDS).
# prev_idx: per token, the row of the previous step's sampled tokens (device-resident) that is
# its input id, or -1 (async scheduling: that token is not on the host yet).
_MD_FIELDS = ("positions", "slot_mapping", "token_to_req", "block_tables", "seq_lens",
              "context_lens", "query_start_loc")

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _register_compile_listener(runner: "ModelRunner") -> None:
    ref = weakref.ref(runner)

    def on_event(name: str, duration: float, **_: Any) -> None:
        r = ref()
        if r is None:
            jax.monitoring.unregister_event_duration_listener(on_event)
        elif name == _COMPILE_EVENT and r._in_step:
            r.num_compiles_after_warmup += 1
            logger.warning("XLA compiled a program while serving (%.2f s): a shape escaped the buckets", duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)


def _unpack(flat: jax.Array, shapes: dict[str, tuple[int, ...]]) -> dict[str, jax.Array]:
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
