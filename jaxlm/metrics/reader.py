"""vLLM's offline metrics reader: Prometheus families -> Metric objects (LLM.get_metrics()).

The same types and rules as vLLM's ``vllm.v1.metrics.reader``: counters, gauges and histograms
of the ``vllm:`` families, and ``vllm:spec_decode_num_accepted_tokens_per_pos`` (one counter
per ``position`` label) folded into one Vector of per-position counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclasses.dataclass
class Metric:
    """A metric's name and labels (one object per label set)."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclasses.dataclass
class Vector(Metric):
    """An ordered array of integer counters (vllm:spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


@dataclasses.dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclasses.dataclass
class Histogram(Metric):
    """Counts per bucket upper bound (cumulative, '+Inf' included), the count and the sum."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: Any) -> list[Metric]:
    """Every vllm: gauge, counter and histogram a prometheus_client registry collects now."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), s.value) for s in _samples(family, "")]
        elif family.type == "counter" and family.name == _PER_POS:
            out += _per_position(family)
        elif family.type == "counter":
            out += [Counter(family.name, dict(s.labels), int(s.value)) for s in _samples(family, "_total")]
        elif family.type == "histogram":
            out += _histograms(family)
    return out


def _samples(family: Any, suffix: str) -> list[Any]:
    return [s for s in family.samples if s.name == family.name + suffix]


def _key(labels: dict[str, str], drop: str) -> frozenset:
    return frozenset((k, v) for k, v in labels.items() if k != drop)


def _per_position(family: Any) -> list[Metric]:
    by_labels: dict[frozenset, dict[int, int]] = {}
    for s in _samples(family, "_total"):
        by_labels.setdefault(_key(s.labels, "position"), {})[int(s.labels["position"])] = int(s.value)
    out: list[Metric] = []
    for key, values in by_labels.items():
        vector = [0] * (max(values) + 1)
        for pos, n in values.items():
            vector[pos] = n
        out.append(Vector(family.name, dict(key), vector))
    return out


def _histograms(family: Any) -> list[Metric]:
    buckets: dict[frozenset, dict[str, int]] = {}
    for s in _samples(family, "_bucket"):
        buckets.setdefault(_key(s.labels, "le"), {})[s.labels["le"]] = int(s.value)
    counts = {frozenset(s.labels.items()): int(s.value) for s in _samples(family, "_count")}
    sums = {frozenset(s.labels.items()): s.value for s in _samples(family, "_sum")}
    return [Histogram(family.name, dict(key), counts.get(key, 0), sums.get(key, 0.0), b)
            for key, b in buckets.items()]
