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

from jaxlm.config.speculative import SpeculativeConfig
from jaxlm.core.request import Request
from jaxlm.core.stats import SpecDecodingStats


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

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.stats.observe_draft(num_draft_tokens, num_accepted_tokens)
