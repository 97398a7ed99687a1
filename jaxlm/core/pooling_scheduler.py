"""The pooling runner's scheduler: prefill-only requests, one forward pass each, no decode and
no KV cache (the pooling runner keeps none: a prompt's hidden states are pooled in the pass that
computes them).

A step is ``rows x seq_len`` tokens from the bucket grid (``PoolingBuckets``): every row one
prompt, padded to the step's length bucket. The oldest waiting request picks the length bucket;
the step is filled first with other requests of that bucket (arrival order), then with shorter
ones, longest first, up to the bucket's row cap. So a burst of mixed lengths runs as steps of
like lengths (little padding), and no request waits behind more than the steps of its own
bucket that were queued before it. Pure Python, no jax.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import deque
from typing import Any

import numpy as np

_MIN_SEQ_BUCKET = 16


@dataclasses.dataclass
class PoolingRequest:
    request_id: str
    prompt_token_ids: list[int]
    token_type_ids: list[int] | None
    params: Any  # PoolingParams
    task: str
    serial: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclasses.dataclass
class PoolingBatch:
    seq_len: int  # the step's length bucket
    rows: int  # the step's row bucket (>= len(requests))
    requests: list[PoolingRequest]


def default_seq_buckets(max_model_len: int) -> list[int]:
    """16, 24, 32, 48, 64, 96, ... (powers of 2 and the half steps between), up to and ending
    at max_model_len: at most ~1/3 of a row is padding."""
    out, b = [], _MIN_SEQ_BUCKET
    while b < max_model_len:
        out.append(b)
        mid = b + b // 2
        if mid < max_model_len:
            out.append(mid)
        b *= 2
    out.append(max_model_len)
    return sorted(set(out))


class PoolingBuckets:
    """The (seq_len, rows) programs: for each length bucket, rows in powers of 4 up to what
    the token budget (and max_num_seqs) allows at that length, and that cap itself (a burst
    fills the cap; powers of 4 keep the program count, and the start-up, small)."""

    def __init__(self, seq_buckets: list[int], max_tokens: int, max_rows: int):
        self.seq_buckets = sorted(seq_buckets)
        self.rows: dict[int, list[int]] = {}
        for L in self.seq_buckets:
            cap = max(1, min(max_rows, max_tokens // L))
            rows = [r for r in (4**i for i in range(cap.bit_length())) if r < cap] + [cap]
            self.rows[L] = rows

    @property
    def max_seq_len(self) -> int:
        return self.seq_buckets[-1]

    def seq_bucket(self, n: int) -> int:
        i = bisect.bisect_left(self.seq_buckets, n)
        if i == len(self.seq_buckets):
            raise ValueError(f"{n} tokens exceed the longest bucket {self.max_seq_len}")
        return self.seq_buckets[i]

    def row_bucket(self, seq_len: int, n: int) -> int:
        rows = self.rows[seq_len]
        return rows[bisect.bisect_left(rows, n)]

    def max_rows(self, seq_len: int) -> int:
        return self.rows[seq_len][-1]

    def programs(self) -> list[tuple[int, int]]:
        return [(L, r) for L in self.seq_buckets for r in self.rows[L]]


class PoolingScheduler:
    def __init__(self, buckets: PoolingBuckets):
        self.buckets = buckets
        self._waiting: dict[int, deque[PoolingRequest]] = {L: deque() for L in buckets.seq_buckets}
        self._serial = itertools.count()
        self._num_waiting = 0

    def add_request(self, req: PoolingRequest) -> None:
        req.serial = next(self._serial)
        self._waiting[self.buckets.seq_bucket(max(1, req.num_tokens))].append(req)
        self._num_waiting += 1

    def abort_requests(self, request_ids: set[str]) -> int:
        removed = 0
        for L, queue in self._waiting.items():
            keep = deque(r for r in queue if r.request_id not in request_ids)
            removed += len(queue) - len(keep)
            self._waiting[L] = keep
        self._num_waiting -= removed
        return removed

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_unfinished_requests(self) -> bool:
        return self._num_waiting > 0

    def schedule(self) -> PoolingBatch | None:
        heads = [(q[0].serial, L) for L, q in self._waiting.items() if q]
        if not heads:
            return None
        _, L = min(heads)
        cap = self.buckets.max_rows(L)
        taken: list[PoolingRequest] = []
        for bucket in reversed([b for b in self.buckets.seq_buckets if b <= L]):
            queue = self._waiting[bucket]
            while queue and len(taken) < cap:
                taken.append(queue.popleft())
            if len(taken) == cap:
                break
        self._num_waiting -= len(taken)
        return PoolingBatch(seq_len=L, rows=self.buckets.row_bucket(L, len(taken)), requests=taken)


def batch_arrays(batch: PoolingBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's host inputs: token ids and token type ids [rows * seq_len], lengths [rows]."""
    R, L = batch.rows, batch.seq_len
    ids = np.zeros((R, L), np.int32)
    types = np.zeros((R, L), np.int32)
    lens = np.zeros((R,), np.int32)
    for i, req in enumerate(batch.requests):
        n = req.num_tokens
        ids[i, :n] = req.prompt_token_ids
        if req.token_type_ids is not None:
            types[i, :n] = req.token_type_ids
        lens[i] = n
    return ids.reshape(-1), types.reshape(-1), lens
