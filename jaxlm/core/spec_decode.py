"""The scheduler's side of speculative decoding (vLLM's scheduling of spec tokens), no jax.

After a step, the runner proposes draft tokens for the requests that sampled
(ModelRunnerOutput.spec_token_ids); the scheduler keeps them on the request and, next step,
schedules a running decode request for 1 + k tokens: its last token plus the drafts, each
counted against the token budget (max_num_seqs counts requests, as in vLLM). Drafts are cut so
the step's outputs can never pass max_tokens or max_model_len. When the outputs come back, the
positions of rejected drafts are rolled back (num_computed_tokens only passes accepted tokens),
so the prefix cache, which caches full blocks below num_computed_tokens, only ever holds
accepted tokens. A request still prefilling, or one with a token in flight (async scheduling),
proposes nothing and gets none.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from jaxlm.config.speculative import SpeculativeConfig
from jaxlm.core.request import Request
from jaxlm.core.stats import SpecDecodingStats

_computed = operator.attrgetter("num_computed_tokens")
_repeat = itertools.repeat


class SpecDecodeScheduling:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_spec_tokens = config.num_speculative_tokens
        # A draft model writes its K/V k positions past the scheduled tokens while it proposes.
        self.num_lookahead_tokens = self.num_spec_tokens if config.uses_draft_model else 0
        self.stats = SpecDecodingStats.new(self.num_spec_tokens)

    def active(self, num_running: int) -> bool:
        """Whether this step speculates (vLLM's disable_by_batch_size: not from that many running
        requests on). A speculating step runs synchronously: drafts need the last token."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def drafts_for(self, request: Request, num_new_tokens: int, token_budget: int, max_model_len: int) -> list[int]:
        """The drafts to verify with a request scheduled for num_new_tokens (without drafts), cut
        to the budget left and to what its length limits can still take."""
        drafts = request.spec_token_ids
        if not drafts or num_new_tokens != 1 or request.num_output_placeholders:
            return []
        room = min(token_budget - 1,
                   request.max_tokens - request.num_output_tokens - 1,
                   max_model_len - request.num_tokens - 1)
        return drafts[:max(room, 0)]

    def lookahead(self, request: Request, num_new_tokens: int, max_model_len: int) -> int:
        """KV slots a draft model writes past the scheduled tokens while it proposes (within
        max_model_len: the runner's block table holds no more)."""
        room = max_model_len - request.num_computed_tokens - num_new_tokens
        return max(0, min(self.num_lookahead_tokens, room))

    def roll_back(self, reqs: list[Request], ids: list[str], spec_tokens: dict[str, list[int]],
                  num_sampled: np.ndarray, ok: np.ndarray) -> None:
        """After a verify step (computed counts already advanced by 1 + drafts): the rejected
        drafts' positions are not computed. num_sampled: each request's tokens from the runner
        (accepted drafts + 1); ok: not failed (only those count in the stats)."""
        n_drafts = np.fromiter(map(len, map(spec_tokens.get, ids, _repeat(()))), np.int64, len(ids))
        has = np.flatnonzero(n_drafts)
        if not len(has):
            return
        accepted = np.clip(num_sampled[has] - 1, 0, n_drafts[has])
        sub = [reqs[i] for i in has.tolist()]
        computed = np.fromiter(map(_computed, sub), np.int64, len(sub)) - n_drafts[has] + accepted
        list(map(setattr, sub, _repeat("num_computed_tokens"), computed.tolist()))
        counted = ok[has]
        self.stats.observe_drafts(n_drafts[has][counted], accepted[counted])

    @staticmethod
    def take_drafts(reqs: list[Request], rows: np.ndarray, spec_token_ids: list[list[int]] | None) -> None:
        """The runner's proposals for the next step (rows: each request's index in the runner's
        output, -1 if absent). Nothing proposed: the scheduled drafts were already cleared."""
        if spec_token_ids is None:
            return
        drafts = list(spec_token_ids) + [[]]  # row -1: none
        list(map(setattr, reqs, _repeat("spec_token_ids"), map(drafts.__getitem__, rows.tolist())))
