"""max_num_queued_reqs counts only the sequences that would have to wait (none while running
slots are free), and one request's n counts as n (issue 17, fairness)."""

from __future__ import annotations

import types

import pytest

from jaxlm.config import SchedulerConfig
from jaxlm.engine.exceptions import QueueFullError
from jaxlm.engine.core import EngineCore
from tests.core.core_sim import make_request, make_scheduler


def _engine(max_num_seqs: int, max_num_queued_reqs: int | None) -> EngineCore:
    # Only the admission bookkeeping: a real Scheduler, no model.
    engine = object.__new__(EngineCore)
    engine.engine_config = types.SimpleNamespace(scheduler_config=SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_queued_reqs=max_num_queued_reqs))
    engine.scheduler = make_scheduler(64, max_num_seqs=max_num_seqs)
    engine._deferred = {}
    return engine


def test_free_slots_admit_even_with_a_zero_queue_limit():
    engine = _engine(max_num_seqs=4, max_num_queued_reqs=0)
    for i in range(4):  # waiting, but each will get a slot: nothing queues
        engine._check_queue(1)
        engine.scheduler.add_request(make_request(f"r{i}", [5, 6], max_tokens=4))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        engine._check_queue(1)


def test_n_counts_as_n_requests():
    engine = _engine(max_num_seqs=2, max_num_queued_reqs=3)
    engine._check_queue(5)  # 2 get slots, 3 wait
    with pytest.raises(QueueFullError):
        engine._check_queue(6)
    engine.scheduler.add_request(make_request("a", [5, 6], max_tokens=4))
    engine._deferred["a"] = [make_request(f"{i}_a", [5, 6], max_tokens=4) for i in range(1, 4)]
    # 4 sequences are unscheduled (1 waiting + 3 deferred siblings): 2 would wait already.
    engine._check_queue(1)
    with pytest.raises(QueueFullError):
        engine._check_queue(2)


def test_no_limit():
    engine = _engine(max_num_seqs=1, max_num_queued_reqs=None)
    engine._check_queue(10**6)
