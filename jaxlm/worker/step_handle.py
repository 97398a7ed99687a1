"""StepHandle: a dispatched step of the ModelRunner; result() brings its tokens back.

ModelRunner.execute_model(so, non_block=True) returns one as soon as the step's programs are
dispatched (async scheduling dispatches the next step before calling result()). result() waits
for the sampled tokens, writes them over the placeholders the dispatch left in the input batch
(only where the request still holds its row: one that finished or was preempted meanwhile is
skipped), gives them to the sampling state, and builds the step's ModelRunnerOutput.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np

from jaxlm.core.outputs import LogprobsLists, ModelRunnerOutput
from jaxlm.worker.input_batch import StepInputs
from jaxlm.worker.request_states import RequestStates


class StepHandle:
    def __init__(self, states: RequestStates, inputs: StepInputs | None, sampler_out: Any = None,
                 placed: tuple[np.ndarray, np.ndarray] | None = None, prompt_lps: Any = None,
                 timer: Any = None) -> None:
        self.states, self.inputs, self.sampler_out, self.prompt_lps = states, inputs, sampler_out, prompt_lps
        # Benchmarks only: the runner's step_timer when the step was dispatched.
        self.timer = timer
        # (rows, positions) of the sampled tokens' placeholders in the input batch.
        self.placed = placed
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            self._result = ModelRunnerOutput.empty() if self.inputs is None else self._finish()
        return self._result

    def _finish(self) -> ModelRunnerOutput:
        inputs, states = self.inputs, self.states
        req_ids = inputs.req_ids
        sampled, logprobs = self._sample_tokens()
        prompt_logprobs = self._prompt_logprobs() if self.prompt_lps is not None else {}
        # One token per sampling request, in req_ids order (sample_req_ids keeps that order;
        # it is req_ids itself when every request samples, the usual decode step).
        if inputs.sample_req_ids is req_ids:
            num_sampled = np.ones(len(req_ids), np.int32)
        else:
            wanted = set(inputs.sample_req_ids)
            num_sampled = np.fromiter(map(wanted.__contains__, req_ids), np.int32, len(req_ids))
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=dict(zip(req_ids, range(len(req_ids)))),
            num_sampled=num_sampled,
            sampled_flat=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed_req_ids=states.take_failed(req_ids),
            grammar_terminated_req_ids=states.grammars.advance_tokens(inputs.sample_req_ids, sampled),
        )

    def _sample_tokens(self) -> tuple[np.ndarray, LogprobsLists | None]:
        """The sampled tokens (sample_req_ids order) and their logprobs rows, if computed."""
        inputs, out, states, timer = self.inputs, self.sampler_out, self.states, self.timer
        if out is None:
            return np.zeros(0, np.int32), None
        req_ids = inputs.sample_req_ids
        n = len(req_ids)
        token_ids = np.asarray(out.sampled_token_ids)[:n]  # waits for the device
        if timer:
            timer.lap("wait")
        live = states.input_batch.fill_placeholders(req_ids, *self.placed, token_ids)
        if live.all():
            states.sampling.record_tokens(req_ids, token_ids)
        else:
            states.sampling.record_tokens(list(itertools.compress(req_ids, live)), token_ids[live])
        logprobs = None
        if out.logprob_token_ids is not None:
            logprobs = LogprobsLists(*(np.asarray(a)[:n] for a in (out.logprob_token_ids, out.logprobs,
                                                                    out.sampled_token_ranks)))
        if timer:
            timer.lap("output")
        return token_ids.astype(np.int32, copy=False), logprobs

    def _prompt_logprobs(self) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt positions computed this step that were not delivered yet."""
        inputs, tracker = self.inputs, self.states.prompt_logprobs
        ids, lps, ranks = jax.device_get(self.prompt_lps)
        out = {}
        for i in tracker.wanted(inputs.req_ids):
            req_id = inputs.req_ids[i]
            start, stop = int(inputs.query_start_loc[i]), int(inputs.query_start_loc[i + 1])
            step_rows = LogprobsLists(ids[start:stop], lps[start:stop], ranks[start:stop])
            out[req_id] = tracker.take(req_id, int(inputs.positions[start]), stop - start, step_rows)
        return out

