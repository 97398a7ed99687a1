"""The C++ paged decode attention (paged_decode.cc) as a JAX function, for XLA:CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def paged_decode_cpu(qf: jax.Array, kv_cache: jax.Array, positions: jax.Array, token_rows: jax.Array,
                     block_tables: jax.Array, num_decode: jax.Array, out: jax.Array, *,
                     window: int | None = None, cap: float | None = None) -> jax.Array:
    """qf [T, Hkv, G, D] f32 (times the softmax scale) -> ``out`` with its first ``num_decode``
    rows replaced: token t attends to keys [lo, positions[t]] of row token_rows[t] read through
    ``block_tables`` from kv_cache [2, NB, BS, Hkv, D] (f32 or bf16), lo = positions[t] + 1 -
    window (or 0). The step's K/V must already be in the cache. Needs load_cpu_kernels()."""
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call("jaxlm_paged_decode", jax.ShapeDtypeStruct(out.shape, jnp.float32),
                            input_output_aliases={6: 0}, vmap_method="sequential")
    return call(qf.astype(jnp.float32), kv_cache, i32(positions), i32(token_rows), i32(block_tables),
                i32(num_decode), out.astype(jnp.float32),
                window=np.int32(window or 0), cap=np.float32(cap or 0.0))
