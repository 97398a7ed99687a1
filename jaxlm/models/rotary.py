"""Rotary position embedding (neox / rotate-half layout, as HF Llama, Mistral and Qwen use).

The config is read from either place transformers uses: ``config.rope_parameters`` (5.x, a
dict holding rope_theta, rope_type and the scaling fields, or one such dict per layer type, as
Gemma 3's sliding/full layers have) or ``config.rope_theta`` + ``config.rope_scaling`` (4.x).
The module is a frozen, hashable dataclass so it can sit on an nnx Module as static data; the
inverse frequencies are host constants folded into the program.

Variants: ``linear`` and ``llama3`` scale the frequencies; ``partial_rotary_factor`` turns only
the first part of each head (Phi-4-mini: 0.75); ``longrope`` (Phi-3 / Phi-4-mini) divides each
frequency by a short or a long factor and scales cos/sin by an attention factor. transformers
picks the factors per forward call from its longest position, which changes the rope of keys
already cached once a sequence crosses ``original_max_position_embeddings``; as vLLM does, the
choice here is static: long factors when the engine's ``max_model_len`` exceeds the original
length, short ones otherwise. A prompt then matches transformers' logits whenever both use the
same factors (every prompt when ``max_model_len`` <= the original length; prompts longer than
it otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.models.config_values import check_float

logger = logging.getLogger(__name__)

# Steps of at least this many tokens compute the cos/sin tables once (see _tables).
_TABLE_TOKENS = 64
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# Older Phi-3 configs call longrope "su"; Qwen2-VL configs call their rope "mrope" (transformers
# reads it as default: the sections are MRotaryEmbedding's).
_ROPE_TYPE_ALIASES = {"su": "longrope", "mrope": "default"}


def _field_value(v: Any) -> Any:
    # Lists of numbers (longrope's factors) become tuples so the fields stay hashable.
    return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else v


def _is_field(key: str, v: Any) -> bool:
    if key in ("rope_theta", "rope_type", "type"):
        return False
    if isinstance(v, (list, tuple)):
        return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
    return isinstance(v, (int, float, str, bool))


def get_rope_parameters(config: Any, layer_type: str | None = None) -> tuple[float, str, tuple[tuple[str, Any], ...]]:
    """(rope_theta, rope_type, scaling fields as sorted items) from an HF config; ``layer_type``
    picks one dict of a per-layer-type ``rope_parameters`` (e.g. "sliding_attention")."""
    params = getattr(config, "rope_parameters", None)
    merged: dict[str, Any] = {}
    if layer_type is not None:
        nested = params.get(layer_type) if isinstance(params, dict) else None
        if not isinstance(nested, dict):
            raise ValueError(f"the config has no rope parameters for layer type {layer_type!r}")
        merged.update(nested)
        theta = merged.get("rope_theta", 10000.0)
    else:
        scaling = getattr(config, "rope_scaling", None)
        theta = getattr(config, "rope_theta", None)
        if isinstance(scaling, dict):
            merged.update(scaling)
        if isinstance(params, dict):
            merged.update(params)
        if theta is None:
            theta = merged.get("rope_theta", 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope_type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    fields = tuple(
        sorted(
            (k, _field_value(v)) for k, v in merged.items() if _is_field(k, v)
        )
    )
    return float(theta), rope_type, fields


@functools.lru_cache(maxsize=64)
def _inv_freq(dim: int, theta: float, rope_type: str, fields: tuple) -> np.ndarray:
    """Inverse frequencies of the ``dim`` rotary features. Same float32 arithmetic as HF."""
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
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
    elif rope_type == "longrope":
        inv_freq = (1.0 / (np.asarray(f["ext_factors"], np.float32) * (np.float32(theta) ** exponent))).astype(np.float32)
    return inv_freq


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
    head_dim: int
    theta: float
    rope_type: str = "default"
    fields: tuple = ()
    # Partial rotary: only the first rotary_dim features of each head turn (None: all of them).
    rotary_dim: int | None = None
    # longrope's attention factor: cos and sin are scaled by it.
    mscale: float = 1.0

    @classmethod
    def from_config(cls, config: Any, head_dim: int, *, layer_type: str | None = None,
                    max_model_len: int | None = None) -> "RotaryEmbedding":
        theta, rope_type, fields = get_rope_parameters(config, layer_type)
        f = dict(fields)
        partial = check_float("partial_rotary_factor", f.get("partial_rotary_factor",
                                                             getattr(config, "partial_rotary_factor", None)), positive=True)
        if partial is not None and partial > 1:
            raise ValueError(f"config partial_rotary_factor={partial}: must be in (0, 1]")
        rotary_dim = int(head_dim * partial) if partial is not None and partial != 1.0 else None
        if rotary_dim is not None and (rotary_dim <= 0 or rotary_dim % 2):
            raise ValueError(f"partial_rotary_factor={partial} gives {rotary_dim} rotary features of a "
                             f"{head_dim}-wide head; an even number > 0 is needed")
        if rope_type == "longrope":
            return _longrope(cls, config, head_dim, theta, f, rotary_dim, max_model_len)
        return cls(head_dim, theta, rope_type, fields, rotary_dim)

    @property
    def dim(self) -> int:
        """Features of each head that turn."""
        return self.rotary_dim or self.head_dim

    def __call__(self, positions: jax.Array, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [T]; q [T, Hq, D], k [T, Hkv, D]."""
        inv_freq = jnp.asarray(_inv_freq(self.dim, self.theta, self.rope_type, self.fields))
        freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
        cos, sin = _tables(freqs, positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        return _apply(q, cos, sin, self.dim), _apply(k, cos, sin, self.dim)


@dataclasses.dataclass(frozen=True)
class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rope (vLLM's name): positions [3, T] (temporal, height, width); the
    rotary frequencies are split into ``mrope_section`` chunks (t, h, w), each turned by its own
    position row. A text token has three equal positions, which is plain rope; an image token
    has its place in the image's grid (multimodal/mrope.py computes the positions)."""

    mrope_section: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: Any, head_dim: int, *, layer_type: str | None = None,
                    max_model_len: int | None = None) -> "MRotaryEmbedding":
        base = RotaryEmbedding.from_config(config, head_dim, layer_type=layer_type, max_model_len=max_model_len)
        if base.rope_type != "default" or base.rotary_dim is not None:
            raise ValueError(f"M-RoPE with rope_type {base.rope_type!r} or partial rotary is not supported")
        section = tuple(int(x) for x in dict(base.fields).get("mrope_section", ()))
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise ValueError(f"rope mrope_section {list(section)} must be 3 numbers summing to head_dim / 2 "
                             f"({head_dim // 2})")
        return cls(head_dim, base.theta, base.rope_type, base.fields, mrope_section=section)

    def __call__(self, positions: jax.Array, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [3, T] (or [T]: text only); q [T, Hq, D], k [T, Hkv, D]."""
        if positions.ndim == 1:
            return super().__call__(positions, q, k)
        inv_freq = jnp.asarray(_inv_freq(self.dim, self.theta, self.rope_type, self.fields))
        # Frequency j turns by the position row of its section (t, h or w).
        row = np.repeat(np.arange(3), self.mrope_section)
        pos = positions.astype(jnp.float32)[row]  # [dim/2, T]
        freqs = pos.T * inv_freq[None, :]  # [T, dim/2]
        cos, sin = _tables(freqs, positions[0])
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _apply(q, cos, sin, self.dim), _apply(k, cos, sin, self.dim)


def _longrope(cls: type, config: Any, head_dim: int, theta: float, f: dict, rotary_dim: int | None,
              max_model_len: int | None) -> RotaryEmbedding:
    """longrope resolved once: the factors this engine uses and the attention factor
    (transformers' formula: sqrt(1 + ln(factor) / ln(original)), factor = max / original)."""
    dim = rotary_dim or head_dim
    max_pos = int(config.max_position_embeddings)
    orig = f.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    orig = int(check_float("original_max_position_embeddings", orig or max_pos, positive=True))
    factors = {}
    for key in ("long_factor", "short_factor"):
        value = f.get(key)
        if value is None or isinstance(value, str) or len(value) != dim // 2:
            raise ValueError(f"longrope rope_scaling needs {key} with {dim // 2} numbers (one per rotary "
                             f"frequency), got {value!r}")
        factors[key] = tuple(check_float(key, v, positive=True) for v in value)
    use_long = (max_model_len if max_model_len is not None else max_pos) > orig
    factor = check_float("factor", f.get("factor"), positive=True) or max_pos / orig
    attn = check_float("attention_factor", f.get("attention_factor"), positive=True)
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    logger.info("longrope: %s factors (max_model_len %s, original_max_position_embeddings %d)",
                "long" if use_long else "short", max_model_len or max_pos, orig)
    chosen = factors["long_factor" if use_long else "short_factor"]
    return cls(head_dim, theta, "longrope", (("ext_factors", chosen),), rotary_dim, float(attn))


def _cos_sin(freqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.cos(freqs), jnp.sin(freqs)


def _tables(freqs: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of ``freqs`` [T, dim/2]. XLA:CPU fuses them into the rotation, evaluating
    them for every head and element, in every layer: 4% of a 512-token prefill. Computed
    inside a conditional (both branches the same) they are one buffer, built once per step
    (the layers' identical conditionals are merged). GPU fusions recompute them for free, and
    a conditional there would read its predicate back to the host: plain there."""
    if positions.shape[0] < _TABLE_TOKENS or jax.default_backend() != "cpu":
        return _cos_sin(freqs)
    return jax.lax.cond(positions[0] >= 0, _cos_sin, _cos_sin, freqs)


def _apply(x: jax.Array, cos: jax.Array, sin: jax.Array, dim: int) -> jax.Array:
    if dim == x.shape[-1]:
        return _rotate(x, cos, sin)
    return jnp.concatenate([_rotate(x[..., :dim], cos, sin), x[..., dim:]], axis=-1)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
