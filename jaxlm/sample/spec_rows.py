"""Sampler rows of a speculative step: a request with k draft tokens samples k + 1 rows.

Row j of a request samples the token after its j-th draft, as if drafts 1..j had been sampled:
its random number is the one a step without speculation would draw at that output position
(row_uniforms(stream, outputs so far + j)), and its processors (penalties, min_tokens, bad words)
see drafts 1..j as outputs. So every verified position is sampled exactly as it would be
without speculation, and a seeded request stays reproducible and batch-invariant.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class SpecRows:
    """Row layout of a step's sampling requests: request i owns rows [first[i], first[i] + per[i])."""

    per: np.ndarray  # [n] rows per request (1 + its drafts)
    first: np.ndarray  # [n] its first row
    offset: np.ndarray  # [rows] the row's position within its request (0 = its last token's row)
    drafts: Sequence[Sequence[int]]

    @classmethod
    def of(cls, drafts: Sequence[Sequence[int]]) -> "SpecRows":
        per = np.fromiter((1 + len(d) for d in drafts), np.int64, len(drafts))
        first = np.cumsum(per) - per
        offset = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(first, per)
        return cls(per, first, offset, drafts)

    @property
    def num_rows(self) -> int:
        return len(self.offset)

    def fill_draft_fields(self, f: dict[str, np.ndarray]) -> None:
        """The rejection sampler's inputs: each row's draft (-1 on a request's last row) and its
        request's first row. Padding rows stand alone (their own first row, no draft)."""
        n = self.num_rows
        ids = f["draft_token_ids"]
        has_draft = self.offset < np.repeat(self.per, self.per) - 1
        ids[:n][has_draft] = np.fromiter(itertools.chain.from_iterable(self.drafts), np.int32,
                                         int(has_draft.sum()))
        f["spec_row_start"][:n] = np.repeat(self.first, self.per)


def neutral_draft_fields(num_rows: int) -> dict[str, np.ndarray]:
    """No drafts: every row is its own request's last row."""
    return {"draft_token_ids": np.full(num_rows, -1, np.int32),
            "spec_row_start": np.arange(num_rows, dtype=np.int32)}


def states_after_drafts(state, drafts: Sequence[int], record) -> list:
    """[state, state after draft 1, ...]: copies advanced with ``record(state, token)`` (the
    builder's per-token update), the original left as it is."""
    out = [state]
    for token in drafts:
        state = dataclasses.replace(
            state, pen_ids=None if state.pen_ids is None else state.pen_ids.copy(),
            pen_counts=None if state.pen_counts is None else state.pen_counts.copy(),
            pen_slot=dict(state.pen_slot), tail=list(state.tail))
        record(state, int(token))
        out.append(state)
    return out
