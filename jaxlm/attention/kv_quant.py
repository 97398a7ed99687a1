"""fp8 KV cache: the storage dtypes, per-tensor K/V scales, quantize on write, fp8 reads.

vLLM's meanings (``--kv-cache-dtype``): ``auto`` is the model's dtype, ``fp8`` is ``fp8_e4m3``
(``jnp.float8_e4m3fn``, max 448), ``fp8_e5m2`` has more range (max 57344) and fewer mantissa
bits. A stored element is ``x / scale`` rounded to nearest and saturated to the format's range
(an fp8 cast alone would turn an out-of-range value into NaN for e4m3fn), so reading one back is
``stored * scale``. The cache array holds an fp8 cache's bytes (``storage_dtype``) and the
attention layers pass its format as ``cache_dtype``. One scale per layer for K and one for V (per-tensor, as fp8 checkpoints ship
them: ``self_attn.k_scale`` / ``self_attn.v_scale``; 1.0 when a checkpoint has none).

The attention paths never multiply a cached element by its scale: scores are linear in K and the
output is linear in V, so ``q . (k8 * ks) = (q * ks) . k8`` and ``sum p (v8 * vs) = vs * sum p v8``.
The backends fold ``k_scale`` into the queries and ``v_scale`` into the output, and every kernel
only converts fp8 to float (``fold_scales``).

``--calculate-kv-scales`` (vLLM's): a layer's scales start at 0 ("not computed yet"); the first
step that writes tokens sets them to max|K| / 200 and max|V| / 100 over that step's real tokens
(vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT), the runner keeps them, and they never change again.

Weight fp8 (issue 37) may share ``FP8_DTYPES`` and ``quantize_fp8``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.config.utils import KV_CACHE_DTYPES

logger = logging.getLogger(__name__)

# vLLM's names -> the JAX storage dtype.
FP8_DTYPES: dict[str, Any] = {
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}
# vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT: a calculated scale maps max|x| to this value.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
# The checkpoint names of a layer's scales, relative to its attention module.
SCALE_NAMES = ("k_scale", "v_scale")


class KVCacheScale(nnx.Variable):
    """A per-tensor K or V scale of one attention layer (f32 scalar; 0 = compute from the first step)."""


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How an fp8 KV cache is kept: storage dtype, and whether the scales come from the first step."""

    dtype: Any
    calculate_scales: bool = False


def is_fp8(dtype: Any) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def resolve_kv_cache_dtype(name: str, model_dtype: Any) -> Any:
    """The cache's storage dtype for a ``--kv-cache-dtype`` value (``auto``: the model's)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"Unknown kv_cache_dtype {name!r}; choose one of: {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name == "bfloat16":
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(FP8_DTYPES[name])


def kv_quant_for(name: str, calculate_scales: bool) -> KVQuant | None:
    """The fp8 settings the attention layers need, or None for a float cache."""
    if name in FP8_DTYPES:
        return KVQuant(jnp.dtype(FP8_DTYPES[name]), calculate_scales)
    return None


def quantize_fp8(x: jax.Array, scale: jax.Array | float, dtype: Any) -> jax.Array:
    """``x / scale`` in ``dtype``, saturated to its finite range (NaN stays NaN)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def to_cache(x: jax.Array, cache_dtype: Any, scale: jax.Array | float | None) -> jax.Array:
    """New K or V as the cache stores it: quantized for fp8, a plain cast otherwise."""
    if is_fp8(cache_dtype):
        return quantize_fp8(x, 1.0 if scale is None else scale, cache_dtype)
    return x.astype(cache_dtype)


def storage_dtype(dtype: Any) -> Any:
    """What the cache array holds: an fp8 cache is kept as its bytes (uint8). XLA:CPU has no fp8
    scatter: on an fp8 array it converts the whole cache to f16 and back around each write (0.96 s
    a layer at SmolLM2's batch 32 x 1,024 tokens), and a bitcast of the whole cache to bytes is a
    copy there too; on bytes the scatter is in place. Readers view the bytes as ``cache_dtype``."""
    return jnp.dtype(jnp.uint8) if is_fp8(dtype) else jnp.dtype(dtype)


def cache_format(kv_cache: jax.Array, cache_dtype: Any = None) -> Any:
    """The cache's element format: ``cache_dtype`` (given for byte storage), else its own dtype."""
    return jnp.dtype(kv_cache.dtype if cache_dtype is None else cache_dtype)


def _bytes(x: jax.Array) -> jax.Array:
    return x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)


def scatter_kv(kv_cache: jax.Array, which: int, index: tuple, x: jax.Array, scale: Any, cache_dtype: Any) -> jax.Array:
    """``kv_cache[which][index] = x`` as the cache stores it (quantized for fp8; dropped out of range)."""
    fmt = cache_format(kv_cache, cache_dtype)
    stored = to_cache(x, fmt, scale)
    if is_fp8(fmt):
        if kv_cache.dtype == jnp.uint8:
            return kv_cache.at[(which, *index)].set(_bytes(stored), mode="drop")
        # An fp8-typed array (tests, direct callers): bytes, then back (a copy on XLA:CPU).
        out = _bytes(kv_cache).at[(which, *index)].set(_bytes(stored), mode="drop")
        return jax.lax.bitcast_convert_type(out, fmt)
    return kv_cache.at[(which, *index)].set(stored, mode="drop")


def read_pages(kv_cache: jax.Array, which: int, pages: jax.Array, cache_dtype: Any = None) -> jax.Array:
    """K (which=0) or V (1) of ``pages`` as f32, raw (the scales are folded elsewhere); byte
    storage is gathered as bytes and viewed as its fp8 format."""
    x = kv_cache[which, pages]
    if x.dtype == jnp.uint8:
        x = jax.lax.bitcast_convert_type(x, cache_format(kv_cache, cache_dtype))
    return x.astype(jnp.float32)


def as_fp8_view(kv_cache: jax.Array, cache_dtype: Any = None) -> jax.Array:
    """The cache typed as its format (byte storage bitcast to fp8) for a kernel that reads fp8."""
    fmt = cache_format(kv_cache, cache_dtype)
    return jax.lax.bitcast_convert_type(kv_cache, fmt) if kv_cache.dtype != fmt else kv_cache


def fold_scales(q: jax.Array, k_scale: Any, v_scale: Any) -> tuple[jax.Array, Any]:
    """(q times k_scale, the factor the output takes): a kernel then reads raw fp8 values."""
    if k_scale is not None:
        q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
    return q, v_scale


# ---- the attention layers' side ------------------------------------------------------------

def add_kv_scales(module: nnx.Module, attn_backend: Any) -> None:
    """Give an attention module its ``k_scale`` / ``v_scale`` when the backend keeps an fp8 cache
    (filled by the loader: the checkpoint's, else 1.0, or 0 to compute them on the first step)."""
    quant = getattr(attn_backend, "kv_quant", None)
    if quant is None:
        module.k_scale = module.v_scale = None
        return
    module.k_scale = KVCacheScale(jnp.zeros((), jnp.float32))
    module.v_scale = KVCacheScale(jnp.zeros((), jnp.float32))


def kv_scale_args(module: nnx.Module, k: jax.Array, v: jax.Array, md: Any) -> dict[str, Any]:
    """The backend's ``k_scale`` / ``v_scale`` / ``cache_dtype`` arguments for this step ({} for a
    float cache); ``cache_dtype``: the fp8 format of the cache's bytes.

    Under --calculate-kv-scales a scale still 0 is computed from this step's real tokens (slot
    >= 0) and stored back into the module, which the runner hands to the next step."""
    if getattr(module, "k_scale", None) is None:
        return {}
    ks, vs = module.k_scale.get_value(), module.v_scale.get_value()
    if module.attn_backend.kv_quant.calculate_scales:
        real = (md.slot_mapping >= 0)[:, None, None]
        ks = _first_step_scale(ks, k, real, K_SCALE_CONSTANT)
        vs = _first_step_scale(vs, v, real, V_SCALE_CONSTANT)
        module.k_scale.set_value(ks)
        module.v_scale.set_value(vs)
    # A step with no real token yet (scale still 0) writes nothing: any non-zero divisor will do.
    return {"k_scale": jnp.where(ks > 0, ks, 1.0), "v_scale": jnp.where(vs > 0, vs, 1.0),
            "cache_dtype": module.attn_backend.kv_quant.dtype}


def _first_step_scale(scale: jax.Array, x: jax.Array, real: jax.Array, constant: float) -> jax.Array:
    amax = jnp.max(jnp.where(real, jnp.abs(x.astype(jnp.float32)), 0.0))
    return jnp.where(scale > 0, scale, amax / constant)


def fill_kv_scales(model: nnx.Module, found: dict[str, float], quant: KVQuant, source: str) -> None:
    """Set every KVCacheScale of ``model``: ``found`` (checkpoint name -> value), else 1.0
    (logged once), or 0 everywhere under --calculate-kv-scales."""
    paths = [(".".join(map(str, p)), v) for p, v in nnx.iter_graph(model) if isinstance(v, KVCacheScale)]
    if quant.calculate_scales:
        if found:
            logger.info("--calculate-kv-scales: the checkpoint's k_scale/v_scale are replaced by the first step's")
        values = {name: 0.0 for name, _ in paths}
    else:
        missing = [name for name, _ in paths if name not in found]
        if missing:
            logger.warning("fp8 KV cache: %s has no k_scale/v_scale for %d of %d scales; using 1.0 for those "
                           "(--calculate-kv-scales computes them from the first batch)", source, len(missing),
                           len(paths))
        values = {name: found.get(name, 1.0) for name, _ in paths}
    for name, var in paths:
        mesh = getattr(model, "mesh", None)
        value = np.float32(values[name])
        if mesh is not None:
            value = jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        else:
            value = jnp.asarray(value)
        var.set_value(value)


def kv_scale_leaf_index(params: Any) -> list[int]:
    """Positions of the KVCacheScale values among ``jax.tree.leaves(params)`` (an nnx State)."""
    variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(variables) != len(jax.tree.leaves(params)):
        raise AssertionError("expected one array per nnx Variable in the model state")
    return [i for i, v in enumerate(variables) if isinstance(v, KVCacheScale)]


def kv_scales_after_step(model: nnx.Module, index: list[int], replicated: Any = None) -> list[jax.Array]:
    """Inside a step's program, after the model ran: the scale values it used (kv_scale_args)."""
    leaves = jax.tree.leaves(nnx.split(model)[1])
    scales = [leaves[i] for i in index]
    if replicated is not None:
        scales = [jax.lax.with_sharding_constraint(x, replicated) for x in scales]
    return scales


def is_kv_scale_name(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in SCALE_NAMES
