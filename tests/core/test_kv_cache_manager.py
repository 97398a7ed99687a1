"""KVCacheManager: allocation, prefix hits, shared ref counts, freeing order."""

from core_sim import make_request

from jaxlm.core.kv_cache_manager import KVCacheManager

BS = 4


def _prefill(kv: KVCacheManager, req, hits=None, num_hit_tokens=0):
    """Admit ``req`` with its prefix hits and compute its whole prompt."""
    req.num_computed_tokens = 0
    new = kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return new


def test_allocate_counts_blocks_and_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))  # 3 blocks
    assert len(kv.allocate_slots(a, 9)) == 3
    b = make_request("b", list(range(50, 59)))
    assert kv.allocate_slots(b, 9) is None
    assert kv.get_num_free_blocks() == 1 and "b" not in kv.req_to_blocks
    # Decode into the partly filled last block needs nothing; the 13th token needs a block.
    a.num_computed_tokens = 9
    assert kv.allocate_slots(a, 3) == []
    assert len(kv.allocate_slots(a, 4)) == 1
    assert kv.get_num_free_blocks() == 0 and kv.usage == 1.0


def test_prefix_hit_shares_blocks_and_ref_counts():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    _prefill(kv, a)
    b = make_request("b", prompt[:8] + [77, 78, 79])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in hits] == kv.get_block_ids("a")[:2]
    _prefill(kv, b, hits, n)
    assert [x.ref_cnt for x in kv.get_blocks("a")] == [2, 2, 1]
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]
    kv.free(a)
    assert [x.ref_cnt for x in kv.get_blocks("b")] == [1, 1, 1]
    kv.free(b)
    assert kv.get_num_free_blocks() == 10
    # Freed blocks stay cached: a third request still hits.
    c = make_request("c", prompt)
    assert kv.get_computed_blocks(c)[1] == 8


def test_never_the_whole_prompt_is_a_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(8))  # exactly 2 full blocks
    _prefill(kv, make_request("a", prompt))
    hits, n = kv.get_computed_blocks(make_request("b", prompt))
    assert n == 4 and len(hits) == 1


def test_same_tokens_under_another_prefix_do_not_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    _prefill(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    _, n = kv.get_computed_blocks(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert n == 0  # block 2 has the same tokens but a different parent


def test_generated_tokens_fill_and_cache_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    _prefill(kv, a)
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    for tok in (7, 8, 9):  # sampled tokens are fed back one by one
        a.append_output_token_ids(tok)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        kv.cache_blocks(a, a.num_computed_tokens)
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    _, n = kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert n == 8


def test_free_releases_tail_first():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(12)))
    _prefill(kv, a)
    ids = kv.get_block_ids("a")
    kv.free(a)
    # The tail goes first; the prefix (most reusable) survives longest.
    got = kv.block_pool.get_new_blocks(1)[0]
    assert got.block_id == ids[2]
    _, n = kv.get_computed_blocks(make_request("b", list(range(12))))
    assert n == 8


def test_hits_on_free_blocks_count_against_free_space():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    _prefill(kv, a)
    kv.free(a)
    assert kv.get_num_free_blocks() == 4
    # b hits 2 free cached blocks and needs 3 more: 5 > 4 free once the hits are taken.
    b = make_request("b", list(range(8)) + list(range(100, 110)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None
    assert all(x.ref_cnt == 0 for x in hits) and kv.get_num_free_blocks() == 4
    c = make_request("c", list(range(8)) + list(range(100, 106)))
    hits, n = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, c.num_tokens - n, hits)
    assert new is not None and len(new) == 2
    assert kv.get_num_free_blocks() == 0
    assert not set(b.block_id for b in new) & set(x.block_id for x in hits)


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(12)))
    _prefill(kv, a)
    assert not kv.block_pool.cached_block_hash_to_block and not a.block_hashes
    assert kv.get_computed_blocks(make_request("b", list(range(12)))) == ([], 0)
    kv.record_prefix_cache_query(12, 0)
    assert kv.prefix_cache_stats.queries == 0
