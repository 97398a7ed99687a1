"""BlockPool free list (LRU), prefix-cache index and block hashes."""

import pytest

from jaxlm.core.block_pool import BlockPool
from jaxlm.core.kv_cache_utils import BlockHash, hash_block_tokens, hash_request_blocks


def _cached_blocks(pool: BlockPool, n: int):
    blocks = pool.get_new_blocks(n)
    parent = None
    for i, b in enumerate(blocks):
        parent = hash_block_tokens(parent, [i, i, i, i])
        assert pool.cache_block(b, parent)
    return blocks


def test_hash_chain_depends_on_parent_and_tokens():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))
    b1 = hash_block_tokens(a, [5, 6, 7, 8])
    other_parent = hash_block_tokens(None, [9, 2, 3, 4])
    b2 = hash_block_tokens(other_parent, [5, 6, 7, 8])
    assert b1 != b2 and b1.hash_value != b2.hash_value
    assert hash_block_tokens(a, [5, 6, 7, 9]) != b1
    # Same hash value but other tokens is a different key (a collision cannot alias blocks).
    assert BlockHash(b1.hash_value, (0, 0, 0, 0)) != b1


def test_hash_request_blocks_is_incremental_and_full_blocks_only():
    tokens = list(range(11))
    hashes: list[BlockHash] = []
    hash_request_blocks(tokens, 4, hashes, 1)
    assert len(hashes) == 1
    first = hashes[0]
    hash_request_blocks(tokens, 4, hashes, 10)  # only 2 full blocks exist
    assert len(hashes) == 2 and hashes[0] is first
    assert hashes[1] == hash_block_tokens(first, [4, 5, 6, 7])


def test_free_list_is_lru_tail_evicted_last():
    pool = BlockPool(4)
    b = _cached_blocks(pool, 4)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0
    pool.free_blocks([b[2], b[0], b[3], b[1]])
    assert pool.get_usage() == 0.0
    # Still cached while free.
    assert all(pool.get_cached_block(x.block_hash) is x for x in b)
    evicted = pool.get_new_blocks(2)
    assert [x.block_id for x in evicted] == [b[2].block_id, b[0].block_id]
    # Eviction drops the hash from the index and from the block.
    assert evicted[0].block_hash is None and evicted[1].block_hash is None
    assert len(pool.cached_block_hash_to_block) == 2
    assert pool.get_cached_block(b[3].block_hash) is b[3]


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    cached = _cached_blocks(pool, 2)
    plain = pool.get_new_blocks(2)
    pool.free_blocks(cached)
    pool.free_blocks(plain)  # freed last, but nothing to keep: reused first
    got = pool.get_new_blocks(2)
    assert {x.block_id for x in got} == {x.block_id for x in plain}
    assert all(pool.get_cached_block(x.block_hash) is x for x in cached)


def test_touch_takes_a_free_cached_block_off_the_free_list():
    pool = BlockPool(3)
    b = _cached_blocks(pool, 3)
    pool.free_blocks(b)
    pool.touch([b[0]])
    assert b[0].ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch([b[0]])
    assert b[0].ref_cnt == 2
    new = pool.get_new_blocks(2)
    assert b[0] not in new
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([b[0]])
    assert b[0].ref_cnt == 1 and pool.get_num_free_blocks() == 0
    pool.free_blocks([b[0]])
    assert pool.get_num_free_blocks() == 1
    with pytest.raises(AssertionError):
        pool.free_blocks([b[0]])


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    x, y = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(x, h)
    assert not pool.cache_block(y, h)
    assert y.block_hash is None and pool.get_cached_block(h) is x


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (x,) = pool.get_new_blocks(1)
    assert not pool.cache_block(x, hash_block_tokens(None, [1]))
    assert not pool.cached_block_hash_to_block


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    b = _cached_blocks(pool, 2)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(b)
    assert pool.reset_prefix_cache()
    assert not pool.cached_block_hash_to_block and all(x.block_hash is None for x in b)
