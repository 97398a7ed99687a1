"""AsyncScheduler: the scheduler for async scheduling (vLLM's AsyncScheduler).

Step N+1 is scheduled before step N's tokens are back on the host. A request that samples in a
step gets a placeholder for that token (Request.num_output_placeholders) and its computed
count advances when the step is scheduled, not when it returns, so the next schedule() already
gives it its next decode token; the runner feeds that token from the previous step's sampled
tokens on the device. When the token arrives (update_from_output, one step later) the
placeholder is dropped; EOS, stop tokens and stop strings then end the request one step late
and the token it computed meanwhile is discarded (the request is gone when it arrives).
max_tokens and max_model_len are checked against the placeholders, so no step is wasted there.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from jaxlm.core.request import Request, RequestStatus
from jaxlm.core.scheduler import Scheduler
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.core.step_update import gather, set_all
from jaxlm.sampling_params import SamplingParams

_placeholders = operator.attrgetter("num_output_placeholders")
_computed = operator.attrgetter("num_computed_tokens")
_all_tokens = operator.attrgetter("all_token_ids")


def needs_host_in_loop(params: SamplingParams) -> bool:
    """Sampling that reads the request's previous token on the host before the next step's
    inputs can be built: grammar masks, penalties, min_tokens and bad words (their counts and
    prefixes live in the runner's SamplingInputBuilder). Steps run synchronously while such
    a request is in the scheduler."""
    return (params.structured_outputs is not None or bool(params.min_tokens) or bool(params.bad_words)
            or bool(params.bad_words_token_ids)
            or (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) != (0.0, 0.0, 1.0))


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Unfinished requests that need the host in the loop (needs_host_in_loop).
        self.host_loop_req_ids: set[str] = set()

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if needs_host_in_loop(request.sampling_params):
            self.host_loop_req_ids.add(request.request_id)

    def needs_sync_step(self) -> bool:
        """Whether the next step must wait for the previous one's tokens (see needs_host_in_loop;
        a step that speculates, or may: its proposer drafts from the last token)."""
        speculating = self.spec is not None and (self._spec_step or self.spec.active(len(self.running)))
        return bool(self.host_loop_req_ids) or speculating

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        # C-level maps, no numpy: its fixed cost per call outweighs the work at small batches.
        scheduled = output.num_scheduled_tokens
        reqs = list(map(self.requests.__getitem__, scheduled))
        computed = list(map(operator.add, map(_computed, reqs), scheduled.values()))
        placeholders = list(map(_placeholders, reqs))
        sampled_upto = computed
        if output.scheduled_spec_decode_tokens:  # a verify step samples where its drafts start
            num_spec = map(len, map(output.scheduled_spec_decode_tokens.get, scheduled, itertools.repeat(())))
            sampled_upto = list(map(operator.sub, computed, num_spec))
        # A request whose computed tokens reach its end samples: that token is in flight.
        ends = map(operator.add, map(len, map(_all_tokens, reqs)), placeholders)
        set_all(reqs, "num_computed_tokens", computed)
        set_all(reqs, "num_output_placeholders",
                list(map(operator.add, placeholders, map(operator.eq, sampled_upto, ends))))

    def _num_tokens_to_compute(self, request: Request) -> int:
        # Nothing more once the tokens in flight reach the request's limit. (Fields, not the
        # properties: this runs for every running request every step.)
        in_flight = request.num_output_placeholders
        num_tokens = len(request.all_token_ids) + in_flight
        if len(request.output_token_ids) + in_flight >= request.max_tokens or num_tokens >= self.max_model_len:
            return 0
        return num_tokens - request.num_computed_tokens

    def _skip_quietly(self, request: Request) -> bool:
        return request.num_output_placeholders > 0

    def _advance_computed_batch(self, requests: list[Request], num_scheduled: np.ndarray) -> None:
        pass  # counted by _update_after_schedule

    def _takes_output_mask(self, statuses: np.ndarray) -> np.ndarray:
        # A request preempted after this step was dispatched still gets the token it sampled.
        return statuses <= RequestStatus.PREEMPTED

    def _partial_mask(self, num_computed: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
        return np.zeros(len(num_computed), bool)  # the runner samples only rows that reached their last token

    def _tokens_arrived_batch(self, requests: list[Request], sampled: np.ndarray) -> None:
        arrived = list(itertools.compress(requests, sampled))
        left = gather(_placeholders, arrived)
        set_all(arrived, "num_output_placeholders", np.maximum(left - 1, 0).tolist())

    def _one_token_arrived(self, requests: list[Request], num_scheduled) -> bool:
        # Counted when scheduled; one in-flight token fewer each (a token that arrives always
        # had its placeholder: a preempted request takes the array path).
        left = list(map(operator.sub, map(_placeholders, requests), itertools.repeat(1)))
        if min(left) < 0:
            return False
        set_all(requests, "num_output_placeholders", left)
        return True

    def _preempt(self, request: Request) -> None:
        super()._preempt(request)
        request.num_output_placeholders = 0  # its in-flight token is appended on arrival

    def _free_finished(self, request: Request) -> None:
        self.host_loop_req_ids.discard(request.request_id)
        super()._free_finished(request)

