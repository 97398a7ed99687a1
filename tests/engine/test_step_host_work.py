"""Per-step host work is done per batch, not per request (issue 27).

A decode step in which nothing finishes, no request fills a KV block and no text streams
(final-only outputs without stop strings, as LLM.generate asks) runs through the host side of
the step: Scheduler.update_from_output, the runner's InputBatch and sampler rows, and the
OutputProcessor. Every line of jaxlm the interpreter executes is counted (sys.settrace): the
count must be the same at 8 and at 64 running requests, so no Python loop over the running
requests is left in those parts (their work per request is numpy or C-level `map`).

Scheduler.schedule() is not covered: its running phase still visits each request in Python.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from jaxlm.core.outputs import ModelRunnerOutput
from jaxlm.engine.output_processor import OutputProcessor
from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sample.metadata import SERVING_VARIANTS
from jaxlm.sampling_params import RequestOutputKind, SamplingParams
from jaxlm.worker.input_batch import InputBatch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))
from core_sim import make_request, make_scheduler  # noqa: E402

_JAXLM = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "jaxlm")
VOCAB, BLOCK = 300, 16


class _Host:
    """The host side of an engine over a fake device: scheduler, runner state, output processor."""

    def __init__(self, batch: int, stop_token_ids: list[int] | None = None) -> None:
        self.sched = make_scheduler(64 * batch, block_size=BLOCK, max_num_seqs=batch, max_num_batched_tokens=1024,
                                    max_model_len=256)
        self.batch = InputBatch(batch, 256, BLOCK)
        self.sampling = SamplingInputBuilder(VOCAB, 256, variants=SERVING_VARIANTS)
        self.out = OutputProcessor(None)
        self.rng = np.random.default_rng(0)
        for i in range(batch):
            params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.FINAL_ONLY,
                                    stop_token_ids=stop_token_ids)
            req = make_request(f"r{i}", [5, 6, 7], eos_token_id=2, max_tokens=100, stop_token_ids=stop_token_ids,
                               output_kind=RequestOutputKind.FINAL_ONLY)
            self.sched.add_request(req)
            self.out.add_request(req.request_id, req.request_id, None, [5, 6, 7], params, 0.0)

    def step(self) -> None:
        so = self.sched.schedule()
        for rid in self.batch.update_states(so):
            self.sampling.remove_request(rid)
        for new in so.scheduled_new_reqs:
            self.sampling.add_request(new.req_id, new.sampling_params, new.prompt_token_ids)
        inputs = self.batch.prepare_inputs(so, 512, 64, 64)
        self.sampling.build_host(inputs.sample_req_ids, 64, self.sampling.variant_of(inputs.sample_req_ids))
        placed = self.batch.append_placeholders(inputs.sample_req_ids)
        self.sampling.count_outputs(inputs.sample_req_ids)
        tokens = self.rng.integers(10, VOCAB, len(inputs.sample_req_ids)).astype(np.int32)  # never eos / stop ids
        self.batch.fill_placeholders(inputs.sample_req_ids, *placed, tokens)
        self.sampling.record_tokens(inputs.sample_req_ids, tokens.tolist())
        sampled = dict(zip(inputs.sample_req_ids, tokens.tolist()))
        mro = ModelRunnerOutput.from_lists(inputs.req_ids, [[sampled[r]] if r in sampled else [] for r in inputs.req_ids])
        self.result = self.out.process_outputs(self.sched.update_from_output(so, mro))
        self.so = so


def _lines_of_one_step(host: _Host, also=()) -> int:
    """Lines of jaxlm (and of the code objects `also`) run by one step, schedule() excluded."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def trace(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(_JAXLM) or frame.f_code in also else None

    # The step minus schedule(): schedule it untraced, then trace the rest of the step.
    schedule = host.sched.schedule
    so = schedule()
    host.sched.schedule = lambda: so
    sys.settrace(trace)
    try:
        host.step()
    finally:
        sys.settrace(None)
        host.sched.schedule = schedule
    return count


@pytest.mark.parametrize("stop_token_ids", [None, [3, 4]])
def test_host_lines_per_decode_step_do_not_grow_with_the_batch(stop_token_ids):
    counts = {}
    for batch in (8, 64):
        host = _Host(batch, stop_token_ids)
        host.step()  # prefill
        host.step()  # first decode step (each request's first token was in the prefill step)
        assert all(len(host.sched.requests[f"r{i}"].output_token_ids) == 2 for i in range(batch))
        counts[batch] = _lines_of_one_step(host)
        # It was a real decode step: every request got its token and none finished or streamed.
        assert len(host.so.num_scheduled_tokens) == batch and not host.result.routed
        assert all(len(host.out.request_states[f"r{i}"].token_ids) == 3 for i in range(batch))
    assert counts[8] == counts[64], counts
    assert counts[8] < 1000  # and the count is that of a batch step, not a per-request one


def test_the_line_count_sees_a_loop_per_request():
    """The measure itself: a per-request Python loop in update_from_output is caught."""
    from jaxlm.core import step_update

    real = step_update.set_all

    def set_all_in_python(items, name, values):
        for item, value in zip(items, values):
            setattr(item, name, value)

    counts = {}
    for batch in (8, 64):
        host = _Host(batch)
        host.step()
        host.step()
        step_update.set_all = set_all_in_python
        try:
            counts[batch] = _lines_of_one_step(host, also={set_all_in_python.__code__})
        finally:
            step_update.set_all = real
    assert counts[64] > counts[8] + 56
