"""Scoring pairs (vLLM's ``score`` / ``rerank``): how texts pair up, and an embedding model's
score (the cosine of the two embeddings). No jax."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def pair_inputs(data_1: Any, data_2: Any) -> list[tuple[Any, Any]]:
    """One against many (1 x N), or N against N: vLLM's rules, with its errors."""
    left = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
    right = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not left or not right:
        raise ValueError("score needs at least one text on each side")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise ValueError(f"score pairs one text with many, or N texts with N: got {len(left)} and {len(right)}")
    return list(zip(left, right))


def cosine_scores(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> list[float]:
    out = []
    for x, y in zip(a, b):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        denom = max(float(np.linalg.norm(x) * np.linalg.norm(y)), 1e-12)
        out.append(float(np.dot(x, y) / denom))
    return out
