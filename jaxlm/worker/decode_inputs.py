"""A decode step's flat inputs: one token per request, from a per-shape template.

InputBatch.prepare_inputs builds any step (prompt chunks, several tokens per request) with
about 70 numpy calls. A decode step, where every request has one token and some context,
needs fewer: positions are the computed counts, every row is its own token, and what depends
only on the shape and the number of requests (query_start_loc, token_to_req, logits_indices,
the padding values) comes from a template copied once per step. numpy's cost per call, not
the data, is the step's host cost at these sizes (PERF_NOTES 2026-11-26). The result is the
same StepInputs, byte for byte (tests/worker/test_decode_inputs.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class DecodeTemplates:
    """Per (token bucket, row bucket, sample capacity, requests): the packed buffer's constant
    part and the fields' offsets. At most one entry per bucket and batch size."""

    def __init__(self) -> None:
        self._templates: dict[tuple[int, int, int, int], tuple[np.ndarray, list]] = {}

    def _template(self, batch: Any, T: int, R_pad: int, S: int, R: int) -> tuple[np.ndarray, list]:
        key = (T, R_pad, S, R)
        if key not in self._templates:
            size, layout = batch._layout(T, R_pad, S)
            packed = np.zeros(size, np.int32)
            x = {f: packed[a:b].reshape(shape) for f, a, b, shape in layout}
            x["query_start_loc"][: R + 1] = np.arange(R + 1)
            x["query_start_loc"][R + 1:] = R
            x["token_to_req"][:R] = np.arange(R)
            x["token_to_req"][R:] = max(R - 1, 0)
            x["slot_mapping"][R:] = -1
            x["prev_idx"][R:] = -1
            x["logits_indices"][:R] = np.arange(R)
            # Views are cut per step: 1-D fields by a slice alone, block_tables reshaped.
            cuts = [(f, a, b, shape if len(shape) > 1 else None) for f, a, b, shape in layout]
            self._templates[key] = (packed, cuts)
        return self._templates[key]

    def prepare(self, batch: Any, req_ids: list[str], rows: np.ndarray, start: np.ndarray,
                T: int, R_pad: int, S: int) -> tuple[np.ndarray, dict[str, np.ndarray], list[str]]:
        """The step's packed buffer, its fields (views) and sampling requests when each request
        in req_ids has one token at position start[i] > 0. `batch`: the InputBatch."""
        R, bs = len(req_ids), batch.block_size
        template, cuts = self._template(batch, T, R_pad, S, R)
        packed = template.copy()
        x = {f: packed[a:b] if shape is None else packed[a:b].reshape(shape) for f, a, b, shape in cuts}
        x["input_ids"][:R] = batch.token_ids[rows, start]
        x["positions"][:R] = start
        x["slot_mapping"][:R] = batch.block_table[rows, start // bs] * bs + start % bs
        x["prev_idx"][:R] = np.where(start == batch.pending_pos[rows], batch.pending_idx[rows], -1)
        x["block_tables"][:R] = batch.block_table[rows]
        seq_lens = x["seq_lens"]
        seq_lens[:R] = start + 1
        x["context_lens"][:R] = start
        # A request samples when its token is the last one it has (a prompt fed one token at a
        # time does not, until its end).
        samples = seq_lens[:R] == batch.num_tokens[rows]
        sample_req_ids = req_ids
        if not samples.all():
            idx = np.flatnonzero(samples)
            x["logits_indices"][:] = 0
            x["logits_indices"][: len(idx)] = idx
            sample_req_ids = list(map(req_ids.__getitem__, idx.tolist()))
        return packed, x, sample_req_ids
