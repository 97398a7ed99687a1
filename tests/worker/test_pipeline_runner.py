"""Micro-batch splitting of the pipeline runner (the engine cases: tests/executor/test_pipeline_parallel.py)."""

from __future__ import annotations

from jaxlm.worker.pipeline_runner import split_micro_batches


def test_contiguous_groups_of_about_equal_tokens():
    sched = {"a": 40, "b": 1, "c": 1, "d": 30, "e": 1}
    groups = split_micro_batches(sched, 2)
    assert groups == [{"a": 40}, {"b": 1, "c": 1, "d": 30, "e": 1}]
    # Decode steps split by rows.
    assert split_micro_batches({r: 1 for r in "abcd"}, 2) == [{"a": 1, "b": 1}, {"c": 1, "d": 1}]


def test_at_most_one_group_per_request_and_none_empty():
    assert split_micro_batches({"a": 5}, 4) == [{"a": 5}]
    groups = split_micro_batches({"a": 100, "b": 1, "c": 1}, 3)
    assert groups == [{"a": 100}, {"b": 1}, {"c": 1}]
    groups = split_micro_batches({"a": 1, "b": 1, "c": 100}, 3)
    assert groups == [{"a": 1}, {"b": 1}, {"c": 100}]
