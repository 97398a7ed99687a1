"""The M-RoPE positions [3, T] of each step, for a model whose rope takes them (``uses_mrope``:
Qwen2.5-VL), as vLLM's runner keeps ``mrope_positions``.

A request with images gets its prompt's positions and its ``mrope_position_delta`` once, when
the runner first sees it (multimodal/mrope.py); a token of the prompt takes its column, a later
token (decode, or a prompt token past the table) its index + delta in all three rows. Text-only
requests have delta 0: their positions are the index, as plain rope. The table goes when the
request finishes or is preempted (a resumed request comes back as new and is computed again).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.multimodal.mrope import mrope_input_positions


class MRopePositions:
    def __init__(self, spatial_merge_size: int):
        self.spatial_merge_size = spatial_merge_size
        self._tables: dict[str, tuple[np.ndarray, int]] = {}  # req_id -> (prompt positions [3, L], delta)

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._tables.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._tables.pop(new.req_id, None)
            if new.mm_features:
                images = [(f.mm_position.offset, f.mm_position.length, tuple(f.grid_thw)) for f in new.mm_features]
                self._tables[new.req_id] = mrope_input_positions(len(new.prompt_token_ids), images,
                                                                 self.spatial_merge_size)

    def step_positions(self, inputs: Any, T: int) -> np.ndarray:
        """[3, T] int32: the step's tokens' M-RoPE positions (padding: its index positions)."""
        out = np.empty((3, T), np.int32)
        out[:] = inputs.positions[:T]  # (broadcast_to + copy: several times slower per step)
        if not self._tables:
            return out
        qsl = inputs.query_start_loc
        for i, req_id in enumerate(inputs.req_ids):
            entry = self._tables.get(req_id)
            if entry is None:
                continue
            table, delta = entry
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            pos = inputs.positions[lo:hi]
            in_prompt = pos < table.shape[1]
            out[:, lo:hi] = np.where(in_prompt, table[:, np.minimum(pos, table.shape[1] - 1)], pos + delta)
        return out
