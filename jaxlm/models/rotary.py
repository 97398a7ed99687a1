"""Rotary position embedding (neox / rotate-half layout, as HF Llama, Mistral and Qwen use).

The config is read from either place transformers uses: ``config.rope_parameters`` (5.x, a
dict holding rope_theta, rope_type and the scaling fields) or ``config.rope_theta`` +
``config.rope_scaling`` (4.x). The module is a frozen, hashable dataclass so it can sit on an
nnx Module as static data; the inverse frequencies are host constants folded into the program.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def get_rope_parameters(config: Any) -> tuple[float, str, tuple[tuple[str, Any], ...]]:
    """(rope_theta, rope_type, scaling fields as sorted items) from an HF config."""
    params = getattr(config, "rope_parameters", None)
    scaling = getattr(config, "rope_scaling", None)
    theta = getattr(config, "rope_theta", None)
    merged: dict[str, Any] = {}
    if isinstance(scaling, dict):
        merged.update(scaling)
    if isinstance(params, dict):
        merged.update(params)
    if theta is None:
        theta = merged.get("rope_theta", 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope_type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    fields = tuple(
        sorted(
            (k, v)
            for k, v in merged.items()
            if k not in ("rope_theta", "rope_type", "type") and isinstance(v, (int, float, str, bool))
        )
    )
    return float(theta), rope_type, fields


@functools.lru_cache(maxsize=64)
def _inv_freq(head_dim: int, theta: float, rope_type: str, fields: tuple) -> np.ndarray:
    # Same float32 arithmetic as HF's default rope init.
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
    f = dict(fields)
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(f["factor"])
    elif rope_type == "llama3":
        factor = float(f["factor"])
        low, high = float(f["low_freq_factor"]), float(f["high_freq_factor"])
        old_ctx = float(f["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, blended, scaled).astype(np.float32)
    return inv_freq


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
    head_dim: int
    theta: float
    rope_type: str = "default"
    fields: tuple = ()

    @classmethod
    def from_config(cls, config: Any, head_dim: int) -> "RotaryEmbedding":
        theta, rope_type, fields = get_rope_parameters(config)
        return cls(head_dim, theta, rope_type, fields)

    def __call__(self, positions: jax.Array, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [T]; q [T, Hq, D], k [T, Hkv, D]."""
        inv_freq = jnp.asarray(_inv_freq(self.head_dim, self.theta, self.rope_type, self.fields))
        freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
        cos = jnp.cos(freqs)[:, None, :]
        sin = jnp.sin(freqs)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
