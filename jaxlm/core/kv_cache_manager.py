"""KVCacheManager: block tables per request on top of the BlockPool, with prefix caching.

A block enters the prefix cache only after its K/V were computed (cache_blocks(), called by the
scheduler from update_from_output), never at allocation time: a request can only hit blocks whose
K/V are already in memory before its step runs, whatever order the runner writes and reads in.
The price: two requests with the same prompt admitted in the same step (n > 1 fan-out) each
compute it in their own blocks; the first to finish a block becomes its cached copy.
"""

from __future__ import annotations

import logging
from typing import Callable

from jaxlm.core.block_pool import BlockPool
from jaxlm.core.kv_cache_utils import BlockHash, KVCacheBlock, cdiv, hash_request_blocks
from jaxlm.core.request import Request
from jaxlm.core.stats import PrefixCacheStats
from jaxlm.multimodal.inputs import block_extra_keys

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # request_id -> its block table (logical order).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- queries ---------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        return hash_request_blocks(
            request.all_token_ids, self.block_size, request.block_hashes, num_blocks, request.lora_int_id,
            self._image_keys(request))

    def _image_keys(self, request: Request) -> Callable[[int], tuple[int, ...]] | None:
        """Block index -> the hashes of the images it holds placeholders of (None: text only)."""
        if not request.mm_features:
            return None
        return lambda i: block_extra_keys(request.mm_features, self.block_size, i)

    # -- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request: (blocks, num_tokens).

        The last token is never a hit (its logits must be computed), so at most
        (num_tokens - 1) // block_size blocks match. Does not take references; pass the blocks
        to allocate_slots(new_computed_blocks=...) to keep them.
        """
        if not self.enable_caching:
            return [], 0
        params = request.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            return [], 0  # every prompt position must be computed to get its logprobs (vLLM too)
        max_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in self._block_hashes(request, max_blocks)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def record_prefix_cache_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (done by the scheduler so retries count once)."""
        if not self.enable_caching:
            return
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += num_query_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full and computed (prompt or generated)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_block.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_block[rid] = num_full

    # -- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` after the request's computed tokens.

        ``new_computed_blocks`` are prefix-cache hits of a request being admitted (it holds no
        blocks yet). ``num_lookahead_tokens``: slots past those (a draft model proposing).
        Returns the newly allocated blocks (not the hits), or None when the free list is too
        short, in which case nothing changes.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        num_new_tokens += num_lookahead_tokens
        if not new_computed_blocks and req_blocks is not None:
            # Hot path (a running request): usually a decode token that fits its last block.
            num_tokens = request.num_computed_tokens + num_new_tokens
            num_new_blocks = -(-num_tokens // self.block_size) - len(req_blocks)
            if num_new_blocks <= 0:
                return []
            if num_new_blocks > self.block_pool.get_num_free_blocks():
                return None
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            return new_blocks

        new_computed_blocks = new_computed_blocks or []
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Hits sitting on the free list leave it when touched: they count against free blocks.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_evictable_hits > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[rid]
            return None
        if new_computed_blocks:
            # Touch before popping new blocks, so a hit is never handed out (evicted) as new.
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[rid] = len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so a sequence's tail is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
