"""BlockPool: the fixed set of KV cache blocks, their free list and the prefix-cache index."""

from __future__ import annotations

import collections
import logging
from typing import Iterable

from jaxlm.core.kv_cache_utils import BlockHash, KVCacheBlock

logger = logging.getLogger(__name__)


class BlockPool:
    """Owns every KVCacheBlock.

    The free list is an LRU: a freed block that holds cached K/V goes to the tail and stays
    findable through ``cached_block_hash_to_block`` until it is handed out again from the head
    (evicted). Blocks with nothing cached go to the head, so they are reused before any cached
    block is evicted. An OrderedDict keyed by block id gives O(1) append, pop-head, and removal
    from the middle (a cache hit on a free block).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue: collections.OrderedDict[int, KVCacheBlock] = collections.OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    # -- queries ---------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (free-but-cached blocks count as free)."""
        return 1.0 - len(self.free_block_queue) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    # -- allocation ------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head of the free list, evicting their cached hashes."""
        if num_blocks > len(self.free_block_queue):
            raise ValueError(
                f"Cannot get {num_blocks} free blocks from the pool ({len(self.free_block_queue)} free)"
            )
        out = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block takes it off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go back to the free list in order.

        Callers pass a sequence's blocks tail first, so its tail is evicted before its prefix.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} freed more often than allocated")
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block
                if block.block_hash is None:
                    # Nothing worth keeping: reuse it before evicting any cached block.
                    self.free_block_queue.move_to_end(block.block_id, last=False)

    # -- prefix cache ----------------------------------------------------------------------

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash; False when it cannot be registered.

        If another block already holds the same hash (two requests computed the same prefix in
        the same step), the first one stays the cached copy and this block stays uncached.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed while no request holds a block."""
        if len(self.free_block_queue) != self.num_blocks:
            logger.warning(
                "Cannot reset the prefix cache: %d blocks still in use",
                self.num_blocks - len(self.free_block_queue),
            )
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
