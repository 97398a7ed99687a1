"""SpecStepHandle: a speculative runner's dispatched step; result() brings back each request's
accepted tokens (1 to k + 1), then the proposer's drafts for its next step.

The sampler's rows come back with -1 on every row past a request's first rejected draft (the
rejection sampler). Per request: its first output fills the placeholder the dispatch left in the
input batch, the further accepted ones are appended behind it, the sampling state counts and
records them all, its logprobs keep one row per output token (LogprobsLists.cu_num_generated_tokens),
and a structured-output request's grammar takes them in order (a token that completes the grammar
ends its output there). Then, when the scheduler asked for it, the proposer drafts from the
updated rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxlm.core.outputs import LogprobsLists, ModelRunnerOutput
from jaxlm.worker.step_handle import StepHandle


class SpecStepHandle(StepHandle):
    def __init__(self, runner: Any, *args: Any) -> None:
        super().__init__(runner, *args)
        # Captured at dispatch: async scheduling may dispatch the next step before result().
        self.propose = runner.propose_after_step

    def _finish(self) -> ModelRunnerOutput:
        inputs, runner = self.inputs, self.runner
        sampled, logprobs = self._accepted_tokens()
        prompt_logprobs = self._prompt_logprobs() if self.prompt_lps is not None else {}
        terminated = runner.grammars.advance_many(sampled)
        for req_id, n in terminated.items():
            sampled[req_id] = sampled[req_id][:n]
        spec = None
        if self.propose:
            drafts = runner.propose_drafts(list(sampled))
            spec = [drafts.get(r, []) for r in inputs.req_ids]
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            req_id_to_index={r: i for i, r in enumerate(inputs.req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in inputs.req_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            failed_req_ids=runner._take_failed(inputs.req_ids),
            grammar_terminated_req_ids=set(terminated),
            spec_token_ids=spec,
        )

    def _accepted_tokens(self) -> tuple[dict[str, list[int]], LogprobsLists | None]:
        inputs, out, runner = self.inputs, self.sampler_out, self.runner
        if out is None:
            return {}, None
        req_ids = inputs.sample_req_ids
        n = len(req_ids)
        per = inputs.num_sample_rows if inputs.num_sample_rows is not None else np.ones(n, np.int64)
        first = np.cumsum(per) - per
        tokens = np.asarray(out.sampled_token_ids)[:int(per.sum())]  # waits for the device
        ok = tokens >= 0
        counts = np.add.reduceat(ok, first).astype(np.int64)
        live = runner.input_batch.fill_placeholders(req_ids, *self.placed, tokens[first])
        extra = np.where(live, counts - 1, 0)
        if extra.any():
            _append_accepted(runner.input_batch, self.placed, first, extra, tokens)
            runner.sampling.count_outputs(req_ids, extra)
        kept = [r for r, keep in zip(req_ids, live) if keep]
        token_lists = np.split(tokens[ok], np.cumsum(counts)[:-1])
        sampled = {r: t.tolist() for r, t in zip(req_ids, token_lists)}
        runner.sampling.record_tokens([r for r in kept for _ in sampled[r]], [t for r in kept for t in sampled[r]])
        logprobs = _logprobs_rows(inputs, out, ok, counts) if out.logprob_token_ids is not None else None
        return sampled, logprobs


def _append_accepted(batch: Any, placed: tuple[np.ndarray, np.ndarray], first: np.ndarray,
                     extra: np.ndarray, tokens: np.ndarray) -> None:
    """Accepted tokens after each request's first output: written behind it in its row."""
    rows, pos = placed
    within = np.arange(int(extra.sum())) - np.repeat(np.cumsum(extra) - extra, extra)
    batch.token_ids[np.repeat(rows, extra), np.repeat(pos, extra) + 1 + within] = \
        tokens[np.repeat(first, extra) + 1 + within]
    batch.num_tokens[rows] += extra.astype(batch.num_tokens.dtype)


def _logprobs_rows(inputs: Any, out: Any, ok: np.ndarray, counts: np.ndarray) -> LogprobsLists:
    """The rows of output tokens, in inputs.req_ids order (request i's are [cu[i], cu[i + 1]))."""
    n_rows = len(ok)
    ids, lps, ranks = (np.asarray(a)[:n_rows][ok] for a in
                       (out.logprob_token_ids, out.logprobs, out.sampled_token_ranks))
    per_req = dict(zip(inputs.sample_req_ids, counts.tolist()))
    num = np.array([per_req.get(r, 0) for r in inputs.req_ids], np.int64)
    cu = np.concatenate([[0], np.cumsum(num)])
    return LogprobsLists(token_ids=ids, logprobs=lps, ranks=ranks, cu_num_generated_tokens=cu)
