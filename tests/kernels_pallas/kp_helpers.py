"""Builders for paged caches full of garbage, shared by the kernels_pallas tests."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

# Tolerances vs. the f32 references: f32 kernels use IEEE dots, so only summation order
# differs; bf16 kernels round q/k/v on load and P to bf16 before P@V (as flash attention does).
TOLS = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def paged_cache(rng, seq_lens, bs, hkv, d, dtype, pages_per_req, garbage=np.nan):
    """Cache [2, NB, bs, hkv, d] where only positions < seq_len of each row hold data.

    Everything else (unused pages, the tail of each row's last page, the pages padded block
    table entries point at) is ``garbage``. Returns (cache, block_tables) as jnp arrays.
    """
    used = [-(-L // bs) for L in seq_lens]
    nb = sum(used) + 3  # + garbage pages
    cache = np.full((2, nb, bs, hkv, d), garbage, np.float32)
    perm = list(rng.permutation(nb))
    garbage_pages = perm[sum(used):]
    tables = np.zeros((len(seq_lens), pages_per_req), np.int32)
    for r, L in enumerate(seq_lens):
        assert used[r] <= pages_per_req
        blocks = [perm.pop(0) for _ in range(used[r])]
        pad = rng.choice(garbage_pages + [0], pages_per_req - used[r])
        tables[r] = blocks + list(pad)
        kv = rng.standard_normal((2, L, hkv, d)).astype(np.float32)
        for p in range(L):
            cache[:, blocks[p // bs], p % bs] = kv[:, p]
    return jnp.asarray(cache, dtype), jnp.asarray(tables)


def assert_close(out, ref, dtype, what=""):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), f"{what}: non-finite values leaked into the output"
    np.testing.assert_allclose(out, ref, err_msg=what, **TOLS[dtype])
