"""Every kernel configuration the runner uses lowers for CUDA on a machine without a GPU.

``jax.export`` with ``platforms=['cuda']`` runs the Pallas -> Triton-IR lowering on CPU, so an
op the Triton backend cannot lower (or a non-power-of-2 block) fails here. The lowered call
is XLA's Triton custom call, which export refuses by default (no compatibility guarantee),
hence the disabled safety check. PTX generation itself (shared-memory fit, register
pressure) still happens only when XLA compiles for a real GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.attention.pallas_backend import PallasBackend, PallasConstraints

# jaxlib <= 0.10.2 lowers pallas_call to this target (XLA compiles the Triton IR);
# newer jaxlibs compile in Python and emit "triton_kernel_call_ffi" instead.
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def export_cuda(fn, *args):
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_TARGETS]
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)


def _specs(T, R, P, hq, hkv, d, bs, dtype, num_blocks=64):
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(positions=i32(T), slot_mapping=i32(T), token_to_req=i32(T),
                           block_tables=i32(R, P), seq_lens=i32(R), context_lens=i32(R),
                           query_start_loc=i32(R + 1))
    arr = lambda *s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    return arr(T, hq, d), arr(T, hkv, d), arr(T, hkv, d), arr(2, num_blocks, bs, hkv, d), md


# (head_dim, block_size, Hq, Hkv, dtype, window, softcap): head dims 64/128/256, pages
# 16/32, GQA 1/4/8 (and MQA), f32 + bf16, with/without window and soft-cap.
CONFIGS = [
    (64, 16, 8, 8, jnp.bfloat16, None, None),
    (128, 16, 32, 8, jnp.bfloat16, None, None),
    (128, 32, 32, 4, jnp.bfloat16, 4096, None),
    (256, 16, 16, 8, jnp.bfloat16, None, 50.0),
    (256, 32, 8, 1, jnp.bfloat16, None, None),
    (128, 16, 12, 4, jnp.float32, 128, 30.0),  # G=3: padded to 4
]


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
@pytest.mark.parametrize("d,bs,hq,hkv,dtype,window,cap", CONFIGS)
def test_backend_lowers_for_cuda(d, bs, hq, hkv, dtype, window, cap, decode):
    c = PallasConstraints.for_cache(bs, d)
    T, R = (16, 16) if decode else (256, 16)
    P = c.round_pages(8192 // bs)
    backend = PallasBackend(interpret=False)
    fn = functools.partial(backend, scale=d ** -0.5, sliding_window=window,
                           logits_soft_cap=cap, max_query_len=1 if decode else None)
    exp = export_cuda(fn, *_specs(T, R, P, hq, hkv, d, bs, dtype))
    text = exp.mlir_module()
    assert sum(text.count(t) for t in TRITON_TARGETS) == 1, "expected exactly one kernel"
    assert exp.platforms == ("cuda",)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
@pytest.mark.parametrize("T", [1, 16, 64, 1024])
def test_bucket_sizes_lower(T, decode):
    # small buckets use split-K (up to max_num_splits), big ones none: all must lower
    c = PallasConstraints.for_cache(16, 128)
    P = c.round_pages(2048 // 16)
    R = min(T, 256)
    tiles = T if decode else min(T, T // c.block_q(32, 8) + R)
    assert (c.num_splits(tiles, 8, P) > 1) == (T <= 16)
    fn = functools.partial(PallasBackend(), scale=0.1, max_query_len=1 if decode else None)
    export_cuda(fn, *_specs(T, R, P, 32, 8, 128, 16, jnp.bfloat16))


def test_long_context_ragged_config_lowers():
    # The static configuration of test_kernels' 2,000-token / prefix-hit case, for CUDA.
    from kernels_pallas.ragged_paged import ragged_paged_attention

    T, R, P, bs, d = 2101, 6, 64, 32, 16
    fn = functools.partial(ragged_paged_attention, scale=0.25, pages_per_compute_block=2, block_q=32, num_splits=2)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    exp = export_cuda(fn, jax.ShapeDtypeStruct((T, 4, d), jnp.float32),
                      jax.ShapeDtypeStruct((2, 70, bs, 1, d), jnp.float32), i32(R, P), i32(R), i32(R + 1))
    assert sum(exp.mlir_module().count(t) for t in TRITON_TARGETS) == 1


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_cache_lowers_for_cuda(cache_dtype, decode):
    """--kv-cache-dtype fp8: both kernels read fp8 pages (converted in registers), the scales
    folded into q and the output; bf16 queries as on a GPU."""
    d, bs, hq, hkv = 128, 16, 32, 8
    c = PallasConstraints.for_cache(bs, d)
    T, R = (16, 16) if decode else (256, 16)
    q, k, v, cache, md = _specs(T, R, c.round_pages(4096 // bs), hq, hkv, d, bs, jnp.bfloat16)
    cache = jax.ShapeDtypeStruct(cache.shape, cache_dtype)
    scales = jax.ShapeDtypeStruct((), jnp.float32)

    def fn(q, k, v, cache, md, ks, vs):
        return PallasBackend()(q, k, v, cache, md, scale=d ** -0.5, max_query_len=1 if decode else None,
                               k_scale=ks, v_scale=vs)

    exp = export_cuda(fn, q, k, v, cache, md, scales, scales)
    text = exp.mlir_module()
    assert sum(text.count(t) for t in TRITON_TARGETS) == 1, "expected exactly one kernel"
    assert exp.out_avals[1].dtype == cache_dtype  # the cache stays fp8
