"""The ``pallas`` attention backend: AttentionMetadata -> kernels_pallas arguments.

One call = (1) scatter this step's K/V into their pages (XLA scatter on the donated cache,
in place), then (2) attention reading every key, old and new, in place from the pages:

  * decode-only steps (every row has <= 1 query token): ``paged_decode_attention``, one
    program per (token, KV head, split) with a split-K merge so small batches with long
    contexts still fill the GPU;
  * everything else (prefill, chunked prefill, prefix hits, mixed): ``ragged_paged_attention``
    over tiles of ``block_q`` tokens of one row (also split-K when the bucket is small).

Which one is a *static* choice: the runner compiles a decode flavour of its body program per
decode-sized token bucket with ``AttentionMetadata.max_query_len == 1`` (a static pytree field)
and runs it for decode-only steps; ``max_query_len=1`` as an argument does the same for direct
callers (tests, benches). Without the hint the ragged kernel runs:
correct for every batch, decode included, and split-K for small buckets too, so the hint
mostly saves the ragged tiles' padded rows (decode tiles are 16 rows, ragged ones ~64).

K/V write: a separate XLA scatter, not fused. It moves T x Hkv x D x 2 elements (KBs) against
a read of the whole context (MBs); fusing needs the cache aliased as a kernel output plus
ordering between programs (the program writing a page is not the one reading it under
split-K), to save one small launch per layer. vLLM splits it the same way
(reshape_and_cache). ``jaxlm bench kernels`` prints kernel vs. kernel+write so the
next GPU session can see what fusing would buy.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from jaxlm.attention.kv_quant import KVQuant, as_fp8_view, fold_scales
from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.attention.xla_backend import paged_attention_xla, write_kv
from kernels_pallas.paged_decode import paged_decode_attention
from kernels_pallas.ragged_paged import (
    default_block_q, num_tiles_bound, ragged_paged_attention)

logger = logging.getLogger(__name__)

# Programs a decode call should launch to fill a GPU (~2 waves of an H100's 132 SMs).
_TARGET_PROGRAMS = 256


@dataclasses.dataclass(frozen=True)
class PallasConstraints:
    """Block sizes the kernels use for one cache geometry, for the runner's buckets.

    * ``decode_pages_per_block`` / ``prefill_pages_per_block``: pages read per inner step
      (pages x block_size must be a power of 2 for the Triton lowering).
    * ``max_num_splits``: most split-K partitions a decode call uses (a power of 2); each
      token's actual key blocks are divided among them at run time.
    * ``page_multiple``: size the block table's page dimension P as a multiple of this
      (``round_pages``) and no call pads the table; any other P still works (padded per call).
    * ``token_multiple``: the kernels take any token count; 1 unless a future kernel needs
      more. The runner passes its token buckets through ``round_tokens`` and sizes its block
      table with ``round_pages`` (``ModelRunner.kernel_constraints``).
    """

    block_size: int
    head_dim: int
    decode_pages_per_block: int
    prefill_pages_per_block: int
    max_num_splits: int = 16
    token_multiple: int = 1

    @classmethod
    def for_cache(cls, block_size: int, head_dim: int) -> "PallasConstraints":
        # ~128 keys per decode step and ~64 per prefill step (half at head_dim 256) keep the
        # K+V tiles of a few pipeline stages inside an SM's shared memory.
        decode_keys = 128 if head_dim <= 128 else 64
        prefill_keys = 64 if head_dim <= 128 else 32
        return cls(block_size=block_size, head_dim=head_dim,
                   decode_pages_per_block=max(1, decode_keys // block_size),
                   prefill_pages_per_block=max(1, prefill_keys // block_size))

    @property
    def supported(self) -> bool:
        """Triton tiles are powers of 2: other head dims / page sizes use the XLA path."""
        pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
        return pow2(self.head_dim) and self.head_dim >= 16 and pow2(self.block_size)

    @property
    def page_multiple(self) -> int:
        # Splits divide each token's real key blocks at run time, so only whole compute
        # blocks constrain the table.
        return math.lcm(self.decode_pages_per_block, self.prefill_pages_per_block)

    def round_pages(self, num_pages: int) -> int:
        m = self.page_multiple
        return -(-num_pages // m) * m

    def round_tokens(self, num_tokens: int) -> int:
        m = self.token_multiple
        return -(-num_tokens // m) * m

    def block_q(self, num_q_heads: int, num_kv_heads: int) -> int:
        """Tokens per prefill tile."""
        return default_block_q(num_q_heads // num_kv_heads)

    def num_splits(self, num_items: int, num_kv_heads: int, pages_per_req: int,
                   pages_per_block: int | None = None) -> int:
        """Split-K factor for ``num_items`` tokens (decode) or tiles (ragged) x KV heads:
        enough programs to fill the GPU, never more splits than compute blocks in the
        table. Static (shapes only), so still one program per bucket; large batches get 1."""
        blocks = max(1, pages_per_req // (pages_per_block or self.decode_pages_per_block))
        want = max(1, _TARGET_PROGRAMS // max(1, num_items * num_kv_heads))
        s = 1
        while s * 2 <= min(want, blocks, self.max_num_splits):
            s *= 2
        return s


@dataclasses.dataclass(frozen=True)
class PallasBackend:
    """AttentionBackend over kernels_pallas; ``interpret=True`` runs the kernels on CPU."""

    interpret: bool = False
    name: str = "pallas"
    # fp8 cache settings the model's attention layers read (None: a float cache).
    kv_quant: KVQuant | None = None

    def constraints(self, block_size: int, head_dim: int) -> PallasConstraints:
        return PallasConstraints.for_cache(block_size, head_dim)

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        max_query_len: int | None = None,
        k_scale: jax.Array | None = None,
        v_scale: jax.Array | None = None,
        cache_dtype=None,
    ) -> tuple[jax.Array, jax.Array]:
        T, Hq, D = q.shape
        _, _, bs, Hkv, _ = kv_cache.shape
        c = self.constraints(bs, D)
        if not c.supported:
            logger.warning("pallas attention: head_dim %d / block_size %d not supported by the "
                           "kernels (powers of 2 needed); using the XLA reference", D, bs)
            return paged_attention_xla(q, k, v, kv_cache, md, scale=scale,
                                       sliding_window=sliding_window,
                                       logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                                       cache_dtype=cache_dtype)
        if max_query_len is None:
            max_query_len = md.max_query_len
        if md.attn_limits is not None and max_query_len != 1:
            # The kernels are causal: a step where some token sees past its position (Gemma 3's
            # image tokens) runs the XLA path instead, decided on the device per step.
            kw = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scale=k_scale,
                      v_scale=v_scale, cache_dtype=cache_dtype)
            causal = dataclasses.replace(md, attn_limits=None)
            return jax.lax.cond(jnp.any(md.attn_limits != md.positions),
                                lambda: paged_attention_xla(q, k, v, kv_cache, md, **kw),
                                lambda: self(q, k, v, kv_cache, causal, max_query_len=max_query_len, **kw))
        kv_cache = write_kv(kv_cache, k, v, md.slot_mapping, k_scale, v_scale, cache_dtype)
        # An fp8 cache: the kernels read raw values; K's scale rides on q, V's on the output.
        q, out_scale = fold_scales(q, k_scale, v_scale)
        pages = as_fp8_view(kv_cache, cache_dtype)  # byte storage, typed as its format
        scale = float(scale)
        if max_query_len == 1:
            # Decode: each real token sees its row's keys [0, position]; padding sees none.
            kv_lens = jnp.where(md.slot_mapping >= 0, md.positions + 1, 0).astype(jnp.int32)
            out = paged_decode_attention(
                q, pages, md.block_tables, md.token_to_req, kv_lens,
                scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                pages_per_compute_block=c.decode_pages_per_block,
                num_splits=c.num_splits(T, Hkv, md.block_tables.shape[1]),
                interpret=self.interpret)
        else:
            bq = c.block_q(Hq, Hkv)
            tiles = num_tiles_bound(T, md.num_rows, bq)
            out = ragged_paged_attention(
                q, pages, md.block_tables, md.context_lens, md.query_start_loc,
                scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                pages_per_compute_block=c.prefill_pages_per_block, block_q=bq,
                num_splits=c.num_splits(tiles, Hkv, md.block_tables.shape[1],
                                        c.prefill_pages_per_block),
                interpret=self.interpret)
        if out_scale is not None:
            out = (out.astype(jnp.float32) * out_scale).astype(out.dtype)
        return out, kv_cache

    def fp8_unsupported(self) -> str | None:
        """Why the kernels cannot read an fp8 cache on this device (None: they can). Triton
        converts fp8 on NVIDIA compute capability 8.9+ (Ada, Hopper) only."""
        if self.interpret:
            return None
        return fp8_capability_problem(getattr(jax.devices()[0], "compute_capability", None))


def fp8_capability_problem(compute_capability: str | None) -> str | None:
    """None when a GPU of this compute capability ("8.9", "9.0") converts fp8 in Triton."""
    try:
        major, minor = (int(x) for x in str(compute_capability).split(".")[:2])
    except ValueError:
        return f"unknown GPU compute capability {compute_capability!r}"
    if (major, minor) < (8, 9):
        return f"GPU compute capability {major}.{minor} < 8.9 has no fp8 conversion in Triton"
    return None


def make_pallas_backend() -> PallasBackend:
    """Registry factory: real kernels on GPU, the same kernels in interpret mode elsewhere."""
    return PallasBackend(interpret=jax.default_backend() != "gpu")
