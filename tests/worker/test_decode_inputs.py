"""A decode step's inputs from DecodeTemplates equal the general path's, byte for byte.

Random batches of one-token-per-request steps (rows in any order, some with a token in flight
from the previous step, some prompts fed one token at a time that do not sample yet, several
batch sizes per shape so one template serves different steps) go through prepare_inputs twice:
as shipped and with the decode path switched off.
"""

from __future__ import annotations

import numpy as np

from jaxlm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxlm.sampling_params import SamplingParams
from jaxlm.worker.input_batch import STEP_FIELDS, InputBatch

BS, MAX_LEN, ROWS = 4, 64, 8


def _so(num: dict[str, int], new=()) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=list(new), scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num.values()),
                           finished_req_ids=set())


def _batch(rng: np.random.Generator) -> tuple[InputBatch, list[str]]:
    batch = InputBatch(ROWS, MAX_LEN, BS)
    ids = [f"r{i}" for i in range(ROWS)]
    new = []
    for i, rid in enumerate(ids):
        prompt = rng.integers(5, 500, rng.integers(2, 40)).tolist()
        new.append(NewRequestData(rid, prompt, [], SamplingParams(), list(range(16 * i, 16 * i + 16)), 0))
    batch.update_states(_so({r: 1 for r in ids}, new))
    for rid in ids:
        row = batch.req_id_to_row[rid]
        n = int(batch.num_tokens[row])
        # Computed up to the last token (decode) or, now and then, a prompt still being fed.
        batch.num_computed_tokens[row] = n - 1 if rng.random() < 0.8 else int(rng.integers(1, n))
        if rng.random() < 0.4:  # a token in flight from the last step: the device feeds it
            batch.pending_pos[row] = n - 1
            batch.pending_idx[row] = int(rng.integers(0, ROWS))
    return batch, ids


def test_decode_path_matches_the_general_path(monkeypatch):
    rng = np.random.default_rng(0)
    taken = 0
    for trial in range(60):
        batch, ids = _batch(rng)
        chosen = [ids[i] for i in rng.permutation(ROWS)[: rng.integers(1, ROWS + 1)]]
        so = _so({r: 1 for r in chosen})
        T = [t for t in (1, 2, 4, 8, 16) if t >= len(chosen)][int(rng.integers(0, 2)) if len(chosen) < 8 else 0]
        R = min(T, ROWS)
        fast = batch.prepare_inputs(so, T, R, 16)
        taken += InputBatch._is_decode(so, batch.num_computed_tokens[[batch.req_id_to_row[r] for r in chosen]])
        with monkeypatch.context() as m:
            m.setattr(InputBatch, "_is_decode", staticmethod(lambda so, start: False))
            slow = batch.prepare_inputs(so, T, R, 16)
        assert fast.req_ids == slow.req_ids and fast.sample_req_ids == slow.sample_req_ids
        assert fast.num_tokens == slow.num_tokens
        assert np.array_equal(fast.packed, slow.packed), trial
        for f in STEP_FIELDS:
            assert np.array_equal(getattr(fast, f), getattr(slow, f)), f
            assert np.shares_memory(getattr(fast, f), fast.packed), f  # views of the one buffer
    assert taken > 40  # the decode path really ran
