"""Persistent host-side batch: one numpy row per running request, kept across steps.

A step only touches the rows it schedules, so building the flat inputs costs O(tokens in the
step) numpy work and no per-request Python objects beyond the req_id -> row map.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from jaxlm.core.sched_output import NewRequestData, SchedulerOutput
from jaxlm.worker.decode_inputs import DecodeTemplates


# The body's per-step int32 inputs, in their order in StepInputs.packed (one host->device
# transfer instead of one per array: measured on CPU ~100 us vs ~500 us for 9 arrays).
STEP_FIELDS = ("input_ids", "positions", "slot_mapping", "token_to_req", "block_tables", "seq_lens",
               "context_lens", "query_start_loc", "logits_indices", "prev_idx")


@dataclasses.dataclass
class StepInputs:
    """Flat, padded inputs of one step (host numpy), in the order of `req_ids`. The arrays are
    views into `packed`, which holds them back to back in STEP_FIELDS order."""

    req_ids: list[str]
    input_ids: np.ndarray  # [T_pad]
    positions: np.ndarray  # [T_pad]
    slot_mapping: np.ndarray  # [T_pad]
    token_to_req: np.ndarray  # [T_pad]
    block_tables: np.ndarray  # [R_pad, P]
    seq_lens: np.ndarray  # [R_pad]
    context_lens: np.ndarray  # [R_pad]
    query_start_loc: np.ndarray  # [R_pad + 1]
    num_tokens: int  # real tokens (<= T_pad)
    # Requests whose last scheduled token is the sequence's last: they sample this step.
    sample_req_ids: list[str]
    # [S_cap] flat index of each sampled row: a request's last token, or with draft tokens
    # (speculative decoding) its last token and every draft, in order.
    logits_indices: np.ndarray
    prev_idx: np.ndarray  # [T_pad] row of the previous step's device tokens feeding this token, or -1
    packed: np.ndarray  # [sum of the above] int32
    # Sampled rows per sampling request (1 + its drafts), None when no request has drafts.
    num_sample_rows: np.ndarray | None = None

    @property
    def num_sampled_rows(self) -> int:
        n = self.num_sample_rows
        return len(self.sample_req_ids) if n is None else int(n.sum())


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, page_multiple: int = 1):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        # Block-table width; attention kernels read whole compute blocks of pages, so it is
        # rounded to their multiple (PallasConstraints.page_multiple) instead of padded per call.
        pages = -(-max_model_len // block_size)
        self.max_pages = -(-pages // page_multiple) * page_multiple
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int32)
        self.block_table = np.zeros((max_num_reqs, self.max_pages), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)
        # A token sampled by a step whose output is not back yet (async scheduling): its
        # position (-1: none) and its row in that step's sampled tokens on the device.
        self.pending_pos = np.full(max_num_reqs, -1, np.int32)
        self.pending_idx = np.zeros(max_num_reqs, np.int32)
        # Draft tokens scheduled this step (speculative decoding), written past num_tokens.
        self.num_spec = np.zeros(max_num_reqs, np.int32)
        self._arange = np.arange(max_num_reqs, dtype=np.int32)
        self.req_id_to_row: dict[str, int] = {}
        self._layouts: dict[tuple[int, int, int], tuple[int, list]] = {}
        self._decode = DecodeTemplates()
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add_request(self, new: NewRequestData) -> int:
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_reqs} requests in the runner")
        row = self._free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.pending_pos[row] = -1
        self.append_blocks(row, new.block_ids)
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        n = self.num_blocks[row]
        self.block_table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def append_placeholders(self, req_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """One token each, sampled but not on the host yet (the i-th of the step's sampled
        tokens); returns (rows, positions) for fill_placeholders."""
        rows = np.fromiter(map(self.req_id_to_row.__getitem__, req_ids), np.int64, len(req_ids))
        pos = self.num_tokens[rows]  # a copy (fancy index)
        self.pending_pos[rows] = pos
        self.pending_idx[rows] = self._arange[: len(req_ids)]
        self.num_tokens[rows] = pos + 1
        return rows, pos

    def fill_placeholders(self, req_ids: list[str], rows: np.ndarray, pos: np.ndarray,
                          token_ids: np.ndarray) -> np.ndarray:
        """The sampled tokens are back: write them where each request still holds its row;
        returns that mask (a request that left meanwhile is skipped)."""
        now = np.fromiter(map(self.req_id_to_row.get, req_ids, itertools.repeat(-1)), np.int64, len(req_ids))
        live = now == rows
        if not live.all():
            rows, pos, token_ids = rows[live], pos[live], token_ids[live]
        self.token_ids[rows, pos] = token_ids
        pending = self.pending_pos[rows]
        self.pending_pos[rows] = np.where(pending == pos, -1, pending)
        return live

    def update_states(self, so: SchedulerOutput) -> list[str]:
        """Apply the scheduler's view; returns the req_ids that left (finished or preempted)."""
        gone = [r for r in (so.finished_req_ids | so.preempted_req_ids) if r in self.req_id_to_row]
        for req_id in gone:
            self.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self.remove_request(new.req_id)  # a resumed request is rebuilt from scratch
            self.add_request(new)
        cached = so.scheduled_cached_reqs
        rows = np.fromiter(map(self.req_id_to_row.__getitem__, cached.req_ids), np.int64, len(cached.req_ids))
        self.num_computed_tokens[rows] = cached.num_computed_tokens
        # New blocks only for the requests that crossed a block boundary.
        for i in itertools.compress(range(len(rows)), cached.new_block_ids):
            self.append_blocks(int(rows[i]), cached.new_block_ids[i])
        self.num_spec[:] = 0
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():  # written past the known tokens
            row = self.req_id_to_row[req_id]
            n = self.num_tokens[row]
            self.token_ids[row, n:n + len(drafts)] = drafts
            self.num_spec[row] = len(drafts)
        return gone

    def step_shapes(self, num_tokens_padded: int, num_rows_padded: int,
                    sample_capacity: int) -> dict[str, tuple[int, ...]]:
        """The shape of each of StepInputs' arrays, in STEP_FIELDS order."""
        T, R = num_tokens_padded, num_rows_padded
        dims = dict(input_ids=(T,), positions=(T,), slot_mapping=(T,), token_to_req=(T,),
                    block_tables=(R, self.max_pages), seq_lens=(R,), context_lens=(R,),
                    query_start_loc=(R + 1,), logits_indices=(sample_capacity,), prev_idx=(T,))
        return {name: dims[name] for name in STEP_FIELDS}

    def _layout(self, T: int, R: int, S: int) -> tuple[int, list[tuple[str, int, int, tuple[int, ...]]]]:
        """(size, [(field, start, stop, shape)]) of the packed buffer, computed once per bucket."""
        key = (T, R, S)
        if key not in self._layouts:
            layout, offset = [], 0
            for f, shape in self.step_shapes(T, R, S).items():
                n = math.prod(shape)
                layout.append((f, offset, offset + n, shape))
                offset += n
            self._layouts[key] = (offset, layout)
        return self._layouts[key]

    @staticmethod
    def _is_decode(so: SchedulerOutput, start: np.ndarray) -> bool:
        """One token per request, each with context and no draft to verify (a verify step has
        1 + k tokens per request and samples each): DecodeTemplates' shorter path applies."""
        return (not so.scheduled_spec_decode_tokens and so.total_num_scheduled_tokens == len(start)
                and bool(start.all()))

    def prepare_inputs(
        self, so: SchedulerOutput, num_tokens_padded: int, num_rows_padded: int, sample_capacity: int
    ) -> StepInputs:
        req_ids = list(so.num_scheduled_tokens)
        n = len(req_ids)
        rows = np.fromiter(map(self.req_id_to_row.__getitem__, req_ids), np.int64, n)
        start = self.num_computed_tokens[rows]
        if self._is_decode(so, start):
            packed, x, sample_req_ids = self._decode.prepare(
                self, req_ids, rows, start, num_tokens_padded, num_rows_padded, sample_capacity)
            return StepInputs(req_ids=req_ids, num_tokens=n, sample_req_ids=sample_req_ids, packed=packed, **x)
        n_sched = np.fromiter(so.num_scheduled_tokens.values(), np.int32, n)
        # One-token (decode) rows first: attention runs those leading rows as mat-vecs and
        # tiles the rest (jaxlm/attention/xla_backend.py). No sort when already in that order.
        multi = n_sched != 1
        if multi.any() and not multi[int(multi.argmax()):].all():
            order = np.argsort(multi, kind="stable")
            req_ids = list(map(req_ids.__getitem__, order.tolist()))
            rows, start, n_sched = rows[order], start[order], n_sched[order]
        R, T, bs = len(req_ids), int(n_sched.sum()), self.block_size
        size, layout = self._layout(num_tokens_padded, num_rows_padded, sample_capacity)
        packed = np.zeros(size, np.int32)
        # Views: filled in place, sent as one buffer.
        x = {f: packed[start:stop].reshape(shape) for f, start, stop, shape in layout}
        cu = x["query_start_loc"]
        cu[1 : R + 1] = np.cumsum(n_sched)
        cu[R + 1 :] = T

        tok_req = np.repeat(np.arange(R, dtype=np.int32), n_sched)
        positions = start[tok_req] + (np.arange(T, dtype=np.int32) - cu[tok_req])
        tok_rows = rows[tok_req]
        blocks = self.block_table[tok_rows, positions // bs]

        x["input_ids"][:T] = self.token_ids[tok_rows, positions]
        x["slot_mapping"][:T] = blocks * bs + positions % bs
        x["slot_mapping"][T:] = -1
        x["positions"][:T] = positions
        x["token_to_req"][:T] = tok_req
        x["token_to_req"][T:] = max(R - 1, 0)
        x["prev_idx"][:T] = np.where(positions == self.pending_pos[tok_rows], self.pending_idx[tok_rows], -1)
        x["prev_idx"][T:] = -1
        x["block_tables"][:R] = self.block_table[rows]
        x["seq_lens"][:R] = start + n_sched
        x["context_lens"][:R] = start

        # A request samples when this step reaches the end of its known tokens (and drafts).
        n_spec = self.num_spec[rows]
        sample_idx = np.flatnonzero((start + n_sched) == self.num_tokens[rows] + n_spec)
        last = cu[sample_idx + 1] - 1
        num_sample_rows = None
        if n_spec.any():  # every draft's position is sampled too, in order
            num_sample_rows = 1 + n_spec[sample_idx]
            first_row = np.cumsum(num_sample_rows) - num_sample_rows
            last = (np.repeat(last - num_sample_rows + 1 - first_row, num_sample_rows)
                    + np.arange(num_sample_rows.sum(), dtype=np.int32))
        x["logits_indices"][: len(last)] = last
        sample_req_ids = req_ids if len(sample_idx) == R else list(map(req_ids.__getitem__, sample_idx.tolist()))
        return StepInputs(req_ids=req_ids, num_tokens=T, sample_req_ids=sample_req_ids, packed=packed,
                          num_sample_rows=num_sample_rows, **x)

    def next_token_ids(self, inputs: StepInputs) -> np.ndarray:
        """[T_pad] the token after each scheduled position (what it predicts); 0 on padding."""
        n = inputs.num_tokens
        rows = np.array([self.req_id_to_row[r] for r in inputs.req_ids])[inputs.token_to_req[:n]]
        out = np.zeros(len(inputs.input_ids), np.int32)
        out[:n] = self.token_ids[rows, np.minimum(inputs.positions[:n] + 1, self.max_model_len - 1)]
        return out
