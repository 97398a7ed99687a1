"""The pooling scheduler: bucket grid, oldest request first, steps of like lengths."""

from __future__ import annotations

import pytest

from jaxlm.core.pooling_scheduler import (
    PoolingBuckets, PoolingRequest, PoolingScheduler, batch_arrays, default_seq_buckets)


def _req(rid: str, n: int, types: bool = False) -> PoolingRequest:
    return PoolingRequest(rid, list(range(1, n + 1)), [0] * (n // 2) + [1] * (n - n // 2) if types else None,
                          None, "embed")


def test_bucket_grid():
    assert default_seq_buckets(128) == [16, 24, 32, 48, 64, 96, 128]
    assert default_seq_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    b = PoolingBuckets([16, 32, 64], max_tokens=256, max_rows=32)
    assert b.rows == {16: [1, 4, 16], 32: [1, 4, 8], 64: [1, 4]}
    assert b.seq_bucket(17) == 32 and b.row_bucket(32, 5) == 8 and b.row_bucket(16, 2) == 4
    assert len(b.programs()) == 8
    with pytest.raises(ValueError, match="exceed the longest bucket 64"):
        b.seq_bucket(65)


def test_oldest_request_picks_the_bucket_then_like_lengths_fill_the_step():
    s = PoolingScheduler(PoolingBuckets([16, 32, 64], max_tokens=128, max_rows=64))
    s.add_request(_req("long", 40))  # bucket 64: 2 rows
    for i in range(5):
        s.add_request(_req(f"short{i}", 10))  # bucket 16: 8 rows
    s.add_request(_req("mid", 20))  # bucket 32
    batch = s.schedule()
    assert batch.seq_len == 64 and batch.rows == 2
    assert [r.request_id for r in batch.requests] == ["long", "mid"]  # then the longest shorter one
    batch = s.schedule()
    assert (batch.seq_len, batch.rows) == (16, 8) and len(batch.requests) == 5
    assert s.schedule() is None and not s.has_unfinished_requests()


def test_abort_and_host_arrays():
    s = PoolingScheduler(PoolingBuckets([16], max_tokens=64, max_rows=4))
    s.add_request(_req("a", 3, types=True))
    s.add_request(_req("b", 5))
    assert s.abort_requests({"b"}) == 1 and s.num_waiting == 1
    batch = s.schedule()
    ids, types, lens = batch_arrays(batch)
    assert batch.rows == 1 and ids.shape == (16,) and list(ids[:4]) == [1, 2, 3, 0]
    assert list(types[:3]) == [0, 1, 1] and list(lens) == [3]
