"""Packed token bitmasks applied to logits: the one device-side piece of structured outputs.

Layout (llguidance's, also vLLM's and xgrammar's): ``bitmask[r, i // 32]`` bit ``i % 32`` set
means token ``i`` is allowed in row ``r``; ``[R, ceil(V/32)]`` int32, so a row costs V/8 bytes
(6 KiB at V = 49152) to send. A row of all -1 allows everything, so rows without a constraint
share the program with constrained ones: one extra sampler input, never a program per grammar.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of ``vocab_size`` ids."""
    return (vocab_size + 31) // 32


def _check_shapes(logits_shape: tuple[int, ...], bitmask_shape: tuple[int, ...]) -> None:
    if len(logits_shape) != 2 or len(bitmask_shape) != 2:
        raise ValueError(f"logits [R, V] and bitmask [R, W] must be 2-D, got {list(logits_shape)} "
                         f"and {list(bitmask_shape)}")
    (r, v), (rb, w) = logits_shape, bitmask_shape
    if rb != r or w != bitmask_width(v):
        raise ValueError(f"bitmask shape {list(bitmask_shape)} does not fit logits {list(logits_shape)}: "
                         f"expected [{r}, {bitmask_width(v)}]")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Set disallowed tokens' logits to -inf. Pure and jit-friendly (shapes are static).

    logits: [R, V] float; bitmask: [R, ceil(V/32)] int32. Returns logits' dtype and shape.
    """
    _check_shapes(logits.shape, bitmask.shape)
    r, v = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    # Arithmetic shift of a negative word still leaves bit k in position 0, so & 1 is exact.
    bits = (bitmask.astype(jnp.int32)[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(r, -1)[:, :v].astype(bool)
    return jnp.where(allowed, logits, jnp.array(-jnp.inf, logits.dtype))


def unpack_bitmask_np(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [R, vocab_size]: which tokens each row allows (unpacks bytes; no shifts)."""
    as_bytes = np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8).reshape(bitmask.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size].astype(bool)


def apply_token_bitmask_np(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Reference for ``apply_token_bitmask`` (a new array, computed a different way)."""
    _check_shapes(logits.shape, bitmask.shape)
    allowed = unpack_bitmask_np(bitmask, logits.shape[1])
    return np.where(allowed, logits, np.array(-np.inf, logits.dtype))


def allowed_token_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The allowed ids of one row (for tests and debugging)."""
    return np.flatnonzero(unpack_bitmask_np(np.asarray(bitmask_row)[None], vocab_size)[0])
