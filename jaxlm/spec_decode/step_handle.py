"""SpecStepHandle: a speculative runner's dispatched step; result() brings back each request's
accepted tokens (1 to k + 1), then the proposer's drafts for its next step.

The sampler's rows come back with -1 on every row past a request's first rejected draft (the
rejection sampler), so a request's outputs are the leading non-negative rows of its segment.
Per request: its first output fills the placeholder the dispatch left in the input batch, the
further accepted ones are written behind it, the sampling state counts and records them all,
its logprobs keep one row per output token (ModelRunnerOutput's layout: back to back), and a
structured-output request's grammar takes them in order (a token that completes the grammar
ends its output there). Then, when the scheduler asked for it, the proposer drafts from the
updated rows. All of it over arrays; Python runs per request only for constrained ones.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np

from jaxlm.core.outputs import LogprobsLists, ModelRunnerOutput
from jaxlm.worker.request_states import RequestStates
from jaxlm.worker.step_handle import StepHandle


class SpecStepHandle(StepHandle):
    def __init__(self, states: RequestStates, *args: Any,
                 propose: Callable[[list[str]], dict[str, list[int]]] | None = None) -> None:
        super().__init__(states, *args)
        # Drafts after this step's tokens (None: the scheduler asked for none: the step did not speculate).
        self.propose = propose

    def _finish(self) -> ModelRunnerOutput:
        inputs, states = self.inputs, self.states
        req_ids = inputs.req_ids
        tokens, counts, logprobs = self._accepted_tokens()
        prompt_logprobs = self._prompt_logprobs() if self.prompt_lps is not None else {}
        terminated = states.grammars.advance_runs(inputs.sample_req_ids, counts, tokens)
        if terminated:  # the grammar ended the output: later tokens are dropped
            tokens, counts, logprobs = _cut(inputs.sample_req_ids, tokens, counts, logprobs, terminated)
        per_req = dict(zip(inputs.sample_req_ids, counts.tolist()))
        spec = None
        if self.propose is not None:
            drafts = self.propose(inputs.sample_req_ids)
            spec = [drafts.get(r, []) for r in req_ids]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=dict(zip(req_ids, range(len(req_ids)))),
            num_sampled=np.fromiter(map(per_req.get, req_ids, itertools.repeat(0)), np.int32, len(req_ids)),
            sampled_flat=tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed_req_ids=states.take_failed(req_ids),
            grammar_terminated_req_ids=set(terminated),
            spec_token_ids=spec,
        )

    def _accepted_tokens(self) -> tuple[np.ndarray, np.ndarray, LogprobsLists | None]:
        """Output tokens back to back (sample_req_ids order), how many each request got, and
        their logprobs rows."""
        inputs, out, states, timer = self.inputs, self.sampler_out, self.states, self.timer
        n = len(inputs.sample_req_ids)
        if out is None:
            return np.zeros(0, np.int32), np.zeros(n, np.int64), None
        req_ids = inputs.sample_req_ids
        per = inputs.num_sample_rows if inputs.num_sample_rows is not None else np.ones(n, np.int64)
        first = np.cumsum(per) - per
        rows = np.asarray(out.sampled_token_ids)[:int(per.sum())]  # waits for the device
        if timer:
            timer.lap("wait")
        ok = rows >= 0
        counts = np.add.reduceat(ok, first).astype(np.int64) if n else np.zeros(0, np.int64)
        tokens = rows[ok].astype(np.int32)
        live = states.input_batch.fill_placeholders(req_ids, *self.placed, rows[first])
        extra = np.where(live, counts - 1, 0)
        if extra.any():
            _append_accepted(states.input_batch, self.placed, first, extra, rows)
            states.sampling.count_outputs(req_ids, extra)
        owners = list(itertools.chain.from_iterable(map(itertools.repeat, req_ids, counts.tolist())))
        if live.all():
            states.sampling.record_tokens(owners, tokens.tolist())
        else:
            keep = np.repeat(live, counts)
            states.sampling.record_tokens(list(itertools.compress(owners, keep)), tokens[keep].tolist())
        logprobs = None
        if out.logprob_token_ids is not None:
            logprobs = LogprobsLists(*(np.asarray(a)[:len(ok)][ok] for a in
                                       (out.logprob_token_ids, out.logprobs, out.sampled_token_ranks)))
        if timer:
            timer.lap("output")
        return tokens, counts, logprobs


def _append_accepted(batch: Any, placed: tuple[np.ndarray, np.ndarray], first: np.ndarray,
                     extra: np.ndarray, rows: np.ndarray) -> None:
    """Accepted tokens after each request's first output: written behind it in its row."""
    batch_rows, pos = placed
    within = np.arange(int(extra.sum())) - np.repeat(np.cumsum(extra) - extra, extra)
    batch.token_ids[np.repeat(batch_rows, extra), np.repeat(pos, extra) + 1 + within] = \
        rows[np.repeat(first, extra) + 1 + within]
    batch.num_tokens[batch_rows] += extra.astype(batch.num_tokens.dtype)


def _cut(req_ids: list[str], tokens: np.ndarray, counts: np.ndarray, logprobs: LogprobsLists | None,
         keep: dict[str, int]) -> tuple[np.ndarray, np.ndarray, LogprobsLists | None]:
    """Keep only the first keep[r] tokens of the requests r in keep."""
    new_counts = counts.copy()
    for i, r in enumerate(req_ids):
        if r in keep:
            new_counts[i] = min(keep[r], counts[i])
    within = np.arange(len(tokens)) - np.repeat(np.cumsum(counts) - counts, counts)
    mask = within < np.repeat(new_counts, counts)
    if logprobs is not None:
        logprobs = LogprobsLists(logprobs.token_ids[mask], logprobs.logprobs[mask], logprobs.ranks[mask])
    return tokens[mask], new_counts, logprobs
