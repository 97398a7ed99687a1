"""The C++ paged decode attention (paged_decode.cc) as a JAX function, for XLA:CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def paged_decode_cpu(qf: jax.Array, kv_cache: jax.Array, positions: jax.Array, token_rows: jax.Array,
                     block_tables: jax.Array, num_decode: jax.Array, out: jax.Array, *,
                     window: int | None = None, cap: float | None = None, cache_dtype=None) -> jax.Array:
    """qf [T, Hkv, G, D] f32 (times the softmax scale) -> ``out`` with its first ``num_decode``
    rows replaced: token t attends to keys [lo, positions[t]] of row token_rows[t] read through
    ``block_tables`` from kv_cache [2, NB, BS, Hkv, D] (f32 or bf16), lo = positions[t] + 1 -
    window (or 0). The step's K/V must already be in the cache. Needs load_cpu_kernels().
    An fp8 cache is float8_e4m3fn / float8_e5m2, or its bytes (uint8) with ``cache_dtype`` naming
    the format; the caller folds its scales into ``qf`` and the result."""
    fp8 = 0
    if kv_cache.dtype == jnp.uint8:
        fp8 = _FP8_FORMATS.get(jnp.dtype(cache_dtype) if cache_dtype is not None else None, 0)
        if not fp8:
            raise ValueError(f"a uint8 KV cache holds fp8 bytes: cache_dtype must be float8_e4m3fn or "
                             f"float8_e5m2, not {cache_dtype!r}")
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call("jaxlm_paged_decode", jax.ShapeDtypeStruct(out.shape, jnp.float32),
                            input_output_aliases={6: 0}, vmap_method="sequential")
    return call(qf.astype(jnp.float32), kv_cache, i32(positions), i32(token_rows), i32(block_tables),
                i32(num_decode), out.astype(jnp.float32),
                window=np.int32(window or 0), cap=np.float32(cap or 0.0), fp8=np.int32(fp8))


# The kernel's ``fp8`` attribute: how to read a uint8 cache.
_FP8_FORMATS = {jnp.dtype(jnp.float8_e4m3fn): 1, jnp.dtype(jnp.float8_e5m2): 2}
