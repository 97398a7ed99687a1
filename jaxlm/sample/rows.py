"""SamplingRows: each live request's per-step sampling values in one numpy row, kept across steps.

A step gathers its rows with one fancy index per array instead of reading every request's
state in Python (vLLM's persistent batch, applied to the sampler's inputs): a row is written
when its request is added and only its output count changes afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Columns of `need`: the SamplerVariant parts a row asks for, in SamplerVariant's field order.
NEED_PARTS = 5


class SamplingRows:
    def __init__(self, capacity: int = 64) -> None:
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._last: tuple = (None, None)  # (req_ids, their slots) of the last slots() call
        # Bumped whenever a row is written or freed: a step's rows are unchanged while it holds.
        self.version = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        old = getattr(self, "temperature", None)
        new = dict(temperature=np.ones(capacity, np.float32), top_k=np.zeros(capacity, np.int32),
                   top_p=np.ones(capacity, np.float32), min_p=np.ones(capacity, np.float32),
                   stream=np.zeros(capacity, np.uint64), num_output=np.zeros(capacity, np.uint64),
                   greedy=np.ones(capacity, np.bool_), need=np.zeros((capacity, NEED_PARTS), np.bool_))
        if old is not None:
            for name, arr in new.items():
                cur = getattr(self, name)
                arr[: len(cur)] = cur
        for name, arr in new.items():
            setattr(self, name, arr)
        start = 0 if old is None else len(old)
        self._free.extend(range(capacity - 1, start - 1, -1))

    def add(self, req_id: str, values: dict, need: Sequence[bool]) -> None:
        """(Re)write req_id's row: values holds temperature, top_k, top_p, min_p, stream, greedy."""
        self._last = (None, None)
        self.version += 1
        slot = self._slot.get(req_id)
        if slot is None:
            if not self._free:
                self._alloc(2 * len(self.temperature))
            slot = self._free.pop()
            self._slot[req_id] = slot
        for name, v in values.items():
            getattr(self, name)[slot] = v
        self.num_output[slot] = 0
        self.need[slot] = need

    def remove(self, req_id: str) -> None:
        self._last = (None, None)
        self.version += 1
        slot = self._slot.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def slots(self, req_ids: Sequence[str]) -> np.ndarray:
        """The rows of req_ids; a step asks for the same list several times (variant, metadata,
        output counts) and consecutive decode steps for an equal one: the last answer is kept
        until the list or a row changes."""
        last_ids, last_slots = self._last
        if req_ids is last_ids or req_ids == last_ids:
            return last_slots
        slots = np.fromiter(map(self._slot.__getitem__, req_ids), np.int64, len(req_ids))
        self._last = (list(req_ids), slots)
        return slots

    def slot(self, req_id: str) -> int:
        return self._slot[req_id]
