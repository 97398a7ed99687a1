"""Which prompt positions still owe their logprobs, per request, across chunks and preemption.

Position p of a prompt of P tokens predicts token p + 1, so positions 0 .. P - 2 each get one
row, delivered in order. A request preempted in the middle of its prefill is recomputed from
its first token when it resumes (prefix caching is off for requests that ask for prompt
logprobs, see KVCacheManager.get_computed_blocks), so the count delivered so far outlives the
preemption and only positions past it are returned again: each row reaches the client once.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxlm.core.outputs import LogprobsLists

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Owed:
    num_prompt_tokens: int
    num_delivered: int = 0  # rows for positions [0, num_delivered) were returned

    @property
    def done(self) -> bool:
        return self.num_delivered >= self.num_prompt_tokens - 1


class PromptLogprobsTracker:
    def __init__(self) -> None:
        self._reqs: dict[str, _Owed] = {}

    def add_request(self, req_id: str, num_prompt_tokens: int) -> None:
        """Register (a resumed request keeps what it was already given)."""
        self._reqs.setdefault(req_id, _Owed(num_prompt_tokens))

    def finish_request(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def owes_any(self, req_ids) -> bool:
        if not self._reqs:  # the usual step: no request asked for prompt logprobs
            return False
        return any(r in self._reqs and not self._reqs[r].done for r in req_ids)

    def wanted(self, req_ids: list[str]) -> list[int]:
        """Indices into req_ids of the requests that still owe prompt logprobs."""
        return [i for i, r in enumerate(req_ids) if r in self._reqs and not self._reqs[r].done]

    def take(self, req_id: str, first_pos: int, num_tokens: int, rows: LogprobsLists) -> LogprobsLists:
        """`rows` hold the logprobs of positions first_pos .. first_pos + num_tokens - 1 (one
        per scheduled token); return only those not delivered yet, and mark them delivered."""
        owed = self._reqs[req_id]
        # Positions whose next token is still part of the prompt, not handed out before.
        start = max(owed.num_delivered, first_pos)
        stop = max(start, min(first_pos + num_tokens, owed.num_prompt_tokens - 1))
        if first_pos > owed.num_delivered:
            # Rows are appended in order on the engine side: a hole would shift every later one.
            logger.error("prompt logprobs of %r: positions %d..%d were never computed; "
                         "returning no more for it", req_id, owed.num_delivered, first_pos - 1)
            owed.num_delivered = owed.num_prompt_tokens - 1
            start = stop = first_pos
        else:
            owed.num_delivered = stop
        lo, hi = start - first_pos, stop - first_pos
        return LogprobsLists(rows.token_ids[lo:hi], rows.logprobs[lo:hi], rows.ranks[lo:hi])

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)
