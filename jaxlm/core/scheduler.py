"""Scheduler: continuous batching with chunked prefill, prefix caching and recompute preemption.

One step = schedule() -> runner -> update_from_output(). Running requests go first (one decode
token each, or the next chunk of a prompt), then waiting requests in FCFS order while the token
budget, max_num_seqs and free blocks allow. When a running request needs a block and none is
free, the newest running request is preempted (its blocks freed, recomputed later). Under
--scheduling-policy priority the waiting queue is ordered by (priority, arrival) and the
victim is the worst running request (core/request_queue.py). Speculative decoding adds draft
tokens to running decode requests (core/spec_decode.py).
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from typing import Iterable

import numpy as np

from jaxlm.config import CacheConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from jaxlm.core import step_update
from jaxlm.core.kv_cache_manager import KVCacheManager
from jaxlm.core.lora_admission import LoRAAdmission, lora_counts
from jaxlm.core.outputs import EngineCoreOutput, EngineCoreOutputBatch, FinishReason, ModelRunnerOutput
from jaxlm.core.request import Request, RequestStatus
from jaxlm.core.request_queue import RequestQueue, create_request_queue
from jaxlm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxlm.core.spec_decode import SpecDecodeScheduling
from jaxlm.core.stats import SchedulerStats
from jaxlm.multimodal.inputs import chunk_end_before_split_item

logger = logging.getLogger(__name__)
_computed = operator.attrgetter("num_computed_tokens")
_all_tokens = operator.attrgetter("all_token_ids")


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 lora_config: LoRAConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set before building the Scheduler")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.disable_chunked_mm_input = scheduler_config.disable_chunked_mm_input
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_gpu_blocks,
            block_size=cache_config.block_size,
            enable_prefix_caching=cache_config.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        # Finished/aborted since the last schedule(): told to the runner in the next output.
        self.finished_req_ids: set[str] = set()
        # Outputs produced outside update_from_output (a request dropped by schedule()).
        self._pending_outputs: list[EngineCoreOutput] = []
        # The last decode step's requests, as core/decode_update.py reuses them.
        self._decode_batch = None
        self.num_preemptions = 0
        self.mm_cache_queries = 0  # images of admitted requests
        self.mm_cache_hits = 0  # ... whose placeholders the prefix cache held: never encoded
        # Speculative decoding (core/spec_decode.py); whether the step being scheduled speculates.
        self.spec = SpecDecodeScheduling(speculative_config) if speculative_config is not None else None
        self._spec_step = False
        # LoRA: at most max_loras distinct adapters running (jaxlm/core/lora_admission.py).
        self.lora = LoRAAdmission(lora_config.max_loras) if lora_config and lora_config.enable_lora else None

    # -- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never run, even alone in the cache."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"Request id {rid!r} is already in the scheduler")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"Request {rid!r}: the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"Request {rid!r}: the prompt ({num_prompt} tokens) leaves no room to generate "
                f"within max_model_len={self.max_model_len}"
            )
        if request.max_tokens is None:
            request.max_tokens = self.max_model_len - num_prompt
        if num_prompt + request.max_tokens > self.max_model_len:
            raise ValueError(
                f"Request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) "
                f"= {num_prompt + request.max_tokens} exceeds max_model_len={self.max_model_len}"
            )
        # The last sampled token is never fed back, so the cache holds at most n - 1 tokens.
        max_cached = num_prompt + request.max_tokens - 1
        blocks_needed = self.kv_cache_manager.get_num_blocks_needed(max_cached)
        if blocks_needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"Request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) "
                f"needs {blocks_needed} KV cache blocks of {self.block_size} tokens but the cache "
                f"has only {self.kv_cache_manager.num_blocks}; lower max_tokens or the prompt length"
            )
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.add_request(request)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        num_scheduled_tokens: dict[str, int] = {}
        cached = CachedRequestData()
        self._spec_step = self.spec is not None and self.spec.active(len(self.running))
        spec_tokens: dict[str, list[int]] = {}
        token_budget, preempted_reqs = self._schedule_running(num_scheduled_tokens, cached, spec_tokens)
        new_reqs_data: list[NewRequestData] = []
        if not preempted_reqs:  # after a preemption blocks are short this step: no admissions
            token_budget = self._schedule_waiting(token_budget, num_scheduled_tokens, new_reqs_data)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted_reqs},
            scheduled_spec_decode_tokens=spec_tokens,
            propose_draft_tokens=self._spec_step,
        )
        self.finished_req_ids = set()
        self._update_after_schedule(output)
        return output

    # -- hooks: AsyncScheduler (jaxlm/core/async_scheduler.py) overrides these --------------

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """Called with each step's output before it runs (sync: nothing to do)."""

    def _num_tokens_to_compute(self, request: Request) -> int:
        return request.num_tokens - request.num_computed_tokens

    def _lookahead(self, request: Request, num_new_tokens: int) -> int:
        return self.spec.lookahead(request, num_new_tokens, self.max_model_len) if self._spec_step else 0

    def _schedule_running(self, num_scheduled_tokens: dict[str, int], cached: CachedRequestData,
                          spec_tokens: dict[str, list[int]]) -> tuple[int, list[Request]]:
        """Running requests: decode tokens and remaining prompt chunks, preempting the newest
        when blocks run out (the policy's victim). Returns (token budget left, preempted requests)."""
        token_budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        preempted_reqs: list[Request] = []
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(self._num_tokens_to_compute(request), token_budget)
            if num_new_tokens > 0 and self.disable_chunked_mm_input and request.mm_features:
                num_new_tokens = chunk_end_before_split_item(request.mm_features, request.num_computed_tokens,
                                                             num_new_tokens)
                if num_new_tokens == 0:  # the next image does not fit this step's budget
                    req_index += 1
                    continue
            if num_new_tokens <= 0 and self._skip_quietly(request):
                req_index += 1
                continue
            if num_new_tokens <= 0:
                # Only if the runner returned no token after a full prefill; skip, don't crash.
                logger.warning("Request %s has no token to compute", request.request_id)
                req_index += 1
                continue
            drafts = (self.spec.drafts_for(request, num_new_tokens, token_budget, self.max_model_len)
                      if self._spec_step else [])
            request.spec_token_ids = []
            num_new_tokens += len(drafts)
            while True:
                new_blocks = kv.allocate_slots(request, num_new_tokens,
                                               num_lookahead_tokens=self._lookahead(request, num_new_tokens))
                if new_blocks is not None:
                    break
                victim_index = self.waiting.preemption_victim(self.running)
                victim = self.running.pop(victim_index)
                if victim_index < req_index:  # scheduled earlier in this step (priority): undo it
                    req_index -= 1
                    cached.remove(victim.request_id)
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    spec_tokens.pop(victim.request_id, None)
                self._preempt(victim)
                preempted_reqs.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            num_scheduled_tokens[request.request_id] = num_new_tokens
            if drafts:
                spec_tokens[request.request_id] = drafts
            token_budget -= num_new_tokens
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else [])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            req_index += 1
        return token_budget, preempted_reqs

    def _schedule_waiting(self, token_budget: int, num_scheduled_tokens: dict[str, int],
                          new_reqs_data: list[NewRequestData]) -> int:
        """Waiting requests in the queue's order, while budget, max_num_seqs and blocks allow; returns the budget left."""
        kv = self.kv_cache_manager
        held: list[Request] = []  # waiting for an adapter slot: they keep their place
        if self.lora is not None:
            self.lora.begin(self.running)
        while self.waiting and token_budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting.peek_request()
            if self.lora is not None and not self.lora.admits(request):
                held.append(self.waiting.pop_request())
                continue
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_computed, token_budget)
            if self.disable_chunked_mm_input and request.mm_features:
                num_new_tokens = chunk_end_before_split_item(request.mm_features, num_computed, num_new_tokens)
                if num_new_tokens == 0:  # its next image does not fit what is left of the budget
                    break
            new_blocks = kv.allocate_slots(request, num_new_tokens, computed_blocks,
                                           self._lookahead(request, num_computed + num_new_tokens))
            if new_blocks is None:
                if not self.running:
                    # Nothing holds a block, so it can never fit: drop it rather than spin.
                    self._drop_unschedulable(request)
                    continue
                break
            self.waiting.pop_request()
            if request.num_cached_tokens < 0:  # first admission (resumes are not counted)
                kv.record_prefix_cache_query(request.num_tokens, num_computed)
                if request.mm_features:
                    self.mm_cache_queries += len(request.mm_features)
                    self.mm_cache_hits += sum(f.mm_position.end <= num_computed for f in request.mm_features)
                request.num_cached_tokens = num_computed
                request.scheduled_ts = time.time()
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            new_reqs_data.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_computed,
                    lora_request=request.lora_request,
                    mm_features=request.mm_features,
                )
            )
        for request in reversed(held):
            self.waiting.prepend_request(request)
        return token_budget

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        logger.debug("Preempted request %s (%d times)", request.request_id, request.num_preemptions)

    def _drop_unschedulable(self, request: Request) -> None:
        logger.error(
            "Request %s needs more KV blocks than the whole cache (%d); aborting it",
            request.request_id,
            self.kv_cache_manager.num_blocks,
        )
        self.waiting.pop_request()
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending_outputs.append(
            EngineCoreOutput(req_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ABORT)
        )

    # -- after the runner ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputBatch:
        """Apply a step's tokens to its requests (over arrays: core/step_update.py)."""
        return step_update.update_from_output(self, scheduler_output, model_runner_output)

    # Batch hooks of update_from_output (AsyncScheduler overrides them).

    def _advance_computed_batch(self, requests: list[Request], num_scheduled: np.ndarray) -> None:
        """A step's tokens are computed (sync: counted when its output comes back)."""
        step_update.set_all(requests, "num_computed_tokens",
                            list(map(operator.add, map(_computed, requests), num_scheduled.tolist())))

    def _one_token_arrived(self, requests: list[Request], num_scheduled: Iterable[int]) -> bool:
        """decode_update's form of the two hooks above, over lists: each request sampled one
        token. Sync: count the step's tokens computed; False (nothing changed) if one of them
        was a prompt chunk short of its end."""
        computed = list(map(operator.add, map(_computed, requests), num_scheduled))
        if computed != list(map(len, map(_all_tokens, requests))):
            return False
        step_update.set_all(requests, "num_computed_tokens", computed)
        return True

    def _takes_output_mask(self, statuses: np.ndarray) -> np.ndarray:
        """Whether a step's output still applies to each request (sync: running ones only)."""
        return statuses == RequestStatus.RUNNING

    def _partial_mask(self, num_computed: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
        """Requests whose step was a prompt chunk short of its end: their token is no sample."""
        return num_computed < num_tokens

    def _tokens_arrived_batch(self, requests: list[Request], sampled: np.ndarray) -> None:
        """A step's output for these requests is in (async: one in-flight token fewer)."""

    def _skip_quietly(self, request: Request) -> bool:
        """A running request with nothing to compute that is expected (async: its last token
        is in flight)."""
        return False

    def _remove_finished(self, finished: list[Request], was_preempted: list[Request]) -> None:
        """Drop requests the step finished from the running list (and, async, the waiting queue)."""
        # One O(running) pass instead of a list.remove per finished request.
        self.running = list(itertools.filterfalse(set(finished).__contains__, self.running))
        if was_preempted:  # async: preempted while its last token was in flight
            self.waiting.remove_requests(was_preempted)
        for request in finished:
            self._free_finished(request)

    # -- finishing -------------------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort); unknown or already finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        to_drop: set[str] = set()
        unqueued: list[Request] = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                to_drop.add(rid)
            else:
                unqueued.append(request)
            self._finish(request, finished_status)
        if to_drop:
            self.running = [r for r in self.running if r.request_id not in to_drop]
        if unqueued:  # one pass over the queue for all of them
            self.waiting.remove_requests(unqueued)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._free_finished(request)

    def _free_finished(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # -- introspection ---------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finished ids not yet told to the runner: worth one more (empty) step."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests() or bool(self._pending_outputs)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        pc = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_preemptions=self.num_preemptions,
            mm_cache_queries=self.mm_cache_queries,
            mm_cache_hits=self.mm_cache_hits,
            spec_decoding_stats=self.spec.stats.copy() if self.spec is not None else None,
            running_lora_adapters=lora_counts(self.running) if self.lora else {},
            waiting_lora_adapters=lora_counts(self.waiting) if self.lora else {},
        )

