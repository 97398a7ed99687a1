"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenize, stop strings, logprobs, n > 1).

A step's EngineCoreOutputBatch is applied as a batch: token ids are appended and the
per-request flags read through `map` (no bytecode per request), and a Python loop runs only
over the requests that stream text, watch stop strings, want logprobs, or finish. A final-only
output (LLM.generate) without stop strings is detokenized when it finishes, not every step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import time
from typing import Any, NamedTuple

import numpy as np

from jaxlm.core.outputs import EngineCoreOutput, EngineCoreOutputBatch, FinishReason, slice_logprobs
from jaxlm.engine.detokenizer import IncrementalDetokenizer
from jaxlm.engine.logprobs import LogprobsProcessor, TokenDecoder
from jaxlm.outputs import CompletionOutput, RequestOutput, RequestStateStats
from jaxlm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ParentRequest:
    """n > 1: the user's request fans out into n child requests sharing the prompt."""

    request_id: str  # internal (client id + suffix): the key outputs are routed by
    external_req_id: str  # the client's: what RequestOutput.request_id shows
    n: int
    latest: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)
    finished: set[int] = dataclasses.field(default_factory=set)


class ProcessedOutputs(NamedTuple):
    """What a step's outputs became: (internal routing id, RequestOutput) pairs for the callers
    (a parent's id for n > 1), the core ids a stop string ended (the core must abort them), and
    core id -> why for requests whose output processing failed (the engine finishes each alone
    with FinishReason.ERROR)."""

    routed: list[tuple[str, RequestOutput]]
    to_abort: list[str]
    failed: dict[str, str]


class RequestState:
    def __init__(self, request_id: str, external_req_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Any, arrival_time: float,
                 parent: ParentRequest | None, index: int, token_decoder: TokenDecoder):
        self.request_id = request_id
        self.external_req_id = external_req_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.parent = parent
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params) if params.detokenize else None
        # detokenize=False means no text at all (vLLM drops the tokenizer for such a request):
        # logprobs carry decoded_token=None instead of a decode per top-k entry per step.
        self.logprobs = (LogprobsProcessor(tokenizer, params, token_decoder) if params.detokenize
                         else LogprobsProcessor(None, params, _NO_TEXT))
        self.token_ids: list[int] = []
        self.sent_tokens = 0
        self.metrics = RequestStateStats(arrival_time=arrival_time, queued_ts=time.time())
        self.num_cached_tokens = 0
        self.final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        # Work per step: detokenize as tokens arrive (streamed text, or stop strings to watch).
        # A final-only output without stop strings decodes at its end, the same algorithm over
        # the same tokens (see detokenize_rest), so its steps only append token ids.
        self.detokenize_each_step = self.detokenizer is not None and (not self.final_only or bool(params.stop))
        self.wants_logprobs = self.logprobs.logprobs is not None
        # Any per-step work besides appending token ids (else only finishing touches it).
        self.works_each_step = self.detokenize_each_step or not self.final_only
        self._num_detokenized = 0  # token_ids already given to the detokenizer

    def detokenize(self, stop_terminated: bool) -> str | None:
        """Feed the detokenizer the tokens it has not seen; the stop string found, if any."""
        new = self.token_ids[self._num_detokenized:]
        self._num_detokenized = len(self.token_ids)
        stop_str = self.detokenizer.update(new, stop_terminated=stop_terminated)
        past = self.detokenizer.tokens_past_stop
        if stop_str is not None and past:  # several tokens a step: none past the stop string
            del self.token_ids[-past:]
            self._num_detokenized = len(self.token_ids)
            self.logprobs.truncate(len(self.token_ids))
        return stop_str

    def completion(self, finish_reason: str | None, stop_reason: Any, delta: bool) -> CompletionOutput:
        finished = finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta) if self.detokenizer else ""
        start = self.sent_tokens if delta else 0
        token_ids = self.token_ids[start:]  # a copy: the caller's to keep
        logprobs = self.logprobs.logprobs
        if logprobs is not None and delta:
            logprobs = logprobs[start:]
        self.sent_tokens = len(self.token_ids)
        return CompletionOutput(
            index=self.index, text=text, token_ids=token_ids,
            cumulative_logprob=self.logprobs.cumulative_logprob, logprobs=logprobs,
            finish_reason=finish_reason, stop_reason=stop_reason,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        # One decoded-token cache for all requests: the vocabulary is shared.
        self.token_decoder = TokenDecoder(tokenizer)
        # Prompt tokens of requests whose prefill finished (vllm:prompt_tokens_total).
        self.num_prompt_tokens_done = 0

    def add_request(self, request_id: str, external_req_id: str, prompt: str | None,
                    prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                    parent: ParentRequest | None = None, index: int = 0) -> None:
        """request_id: the internal (core) id; external_req_id: the client's."""
        self.request_states[request_id] = RequestState(
            request_id, external_req_id, prompt, prompt_token_ids, params, self.tokenizer, arrival_time, parent, index,
            self.token_decoder)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def internal_ids_of(self, external_req_ids: list[str]) -> list[str]:
        """Internal ids (a parent's for n > 1) of the live requests with these client ids."""
        wanted = set(external_req_ids)
        return list({(st.parent.request_id if st.parent else rid): None
                     for rid, st in self.request_states.items() if st.external_req_id in wanted})

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these requests (internal ids; a parent's takes its children); returns the core
        ids to abort."""
        request_ids = set(request_ids)
        core_ids = []
        for req_id, state in list(self.request_states.items()):
            if req_id in request_ids or (state.parent and state.parent.request_id in request_ids):
                del self.request_states[req_id]
                core_ids.append(req_id)
        return core_ids

    def process_outputs(self, batch: EngineCoreOutputBatch | list[EngineCoreOutput]) -> ProcessedOutputs:
        """One step's outputs -> the RequestOutputs to hand to callers (see ProcessedOutputs)."""
        if isinstance(batch, list):
            batch = EngineCoreOutputBatch.from_outputs(batch)
        n = len(batch)
        result = ProcessedOutputs([], [], {})
        if not n:
            return result
        now = time.time()
        states = list(map(self.request_states.get, batch.req_ids))
        counts = batch.num_new_tokens
        tokens = batch.new_token_ids.tolist()
        if len(tokens) == n and None not in states and counts.all():
            got, sub = None, states  # one token each, every request live: the usual decode step
            list(map(list.append, map(_token_ids, states), tokens))
            list(map(setattr, map(_metrics, states), itertools.repeat("last_token_ts"), itertools.repeat(now)))
        else:
            live = np.fromiter(map(operator.is_not, states, itertools.repeat(None)), bool, n)  # aborted meanwhile
            got = np.flatnonzero(live & (counts > 0)).tolist()
            sub = states if len(got) == n else list(map(states.__getitem__, got))
            if got:
                self._append_tokens(sub, got, tokens, batch.token_offsets(), now)
        indices = range(n) if got is None else got  # the requests whose tokens were appended
        for i, cached in batch.num_cached_tokens.items():  # with a request's first tokens
            if states[i] is not None:
                states[i].num_cached_tokens = cached
                if counts[i] and states[i].metrics.first_token_ts is None:
                    self.update_stats_first(states[i], now)
        for i, ts in batch.scheduled_ts.items():
            if states[i] is not None and states[i].metrics.scheduled_ts is None:
                states[i].metrics.scheduled_ts = ts
        if batch.new_logprobs is not None and sub:
            offsets = batch.token_offsets()
            for i in itertools.compress(indices, map(_wants_logprobs, sub)):
                states[i].logprobs.update_from_output(
                        slice_logprobs(batch.new_logprobs, int(offsets[i]), int(offsets[i + 1])))
        for i, lp in batch.new_prompt_logprobs.items():
            if states[i] is not None:
                states[i].logprobs.update_from_output(None, lp)
        # The requests with work beyond the appends: streamed text, stop strings, finishes
        # (none in a final-only decode step without stop strings: no loop then).
        work = list(itertools.compress(indices, map(_works_each_step, sub)))
        if batch.finish_reasons or batch.new_prompt_logprobs:
            work = sorted(set(work).union(batch.finish_reasons, batch.new_prompt_logprobs))
        for i in work:
            if states[i] is None:
                continue
            try:
                self._finish_one(states[i], batch, i, int(counts[i]), result)
            except Exception as e:  # noqa: BLE001 - attributed to this request only
                logger.exception("request %s: processing its output failed", batch.req_ids[i])
                result.failed[batch.req_ids[i]] = f"{type(e).__name__}: {e}"
        return result

    @staticmethod
    def _append_tokens(sub: list, got: list[int], tokens: list[int], offsets: np.ndarray, now: float) -> None:
        """Token ids onto the states `sub` (the requests `got` of the batch), and their time."""
        if len(tokens) == len(sub):  # one token each: the usual decode step
            list(map(list.append, map(_token_ids, sub), tokens))
        else:
            lo, hi = offsets[got].tolist(), offsets[1:][got].tolist()
            list(map(list.extend, map(_token_ids, sub), map(tokens.__getitem__, map(slice, lo, hi))))
        list(map(setattr, map(_metrics, sub), itertools.repeat("last_token_ts"), itertools.repeat(now)))

    def _finish_one(self, state: RequestState, batch: EngineCoreOutputBatch, i: int, count: int,
                    result: ProcessedOutputs) -> None:
        """Detokenize (stop strings), finish and build the output of one request with work."""
        reason = batch.finish_reasons.get(i)
        finish_reason = str(reason) if reason is not None else None
        stop_reason = batch.stop_reasons.get(i)
        if state.detokenizer is not None and (state.detokenize_each_step or finish_reason is not None):
            # A stop token (eos / stop_token_ids) that ended the request is not shown as text;
            # a request a grammar ended with "stop" ends on an ordinary token.
            stop_terminated = (reason == FinishReason.STOP and count > 0
                               and state.token_ids[-1] in state.params.all_stop_token_ids)
            stop_str = state.detokenize(stop_terminated)
            if stop_str is not None and finish_reason is None:
                finish_reason, stop_reason = str(FinishReason.STOP), stop_str
                result.to_abort.append(state.request_id)
        if finish_reason is not None:
            del self.request_states[state.request_id]
        ro = self.make_output(state, finish_reason, stop_reason)
        if ro is not None:
            result.routed.append((state.parent.request_id if state.parent else state.request_id, ro))

    def update_stats_first(self, state: RequestState, now: float) -> None:
        """The request's first tokens arrived: TTFT, and its prompt counts as done."""
        m = state.metrics
        m.first_token_ts = now
        m.first_token_latency = now - m.arrival_time
        self.num_prompt_tokens_done += len(state.prompt_token_ids)

    def make_output(self, state: RequestState, finish_reason: str | None, stop_reason: Any) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        state.metrics.num_generation_tokens = len(state.token_ids)
        completion = state.completion(finish_reason, stop_reason, delta=delta)
        parent = state.parent
        prompt_logprobs = state.logprobs.pop_prompt_logprobs() if delta else state.logprobs.prompt_logprobs
        if parent is None:
            outputs, request_id, all_done = [completion], state.external_req_id, finished
        else:
            parent.latest[state.index] = completion
            if finished:
                parent.finished.add(state.index)
            all_done = len(parent.finished) == parent.n
            request_id = parent.external_req_id
            if kind == RequestOutputKind.FINAL_ONLY:
                if not all_done:
                    return None
                outputs = [parent.latest[i] for i in range(parent.n)]
            elif delta:
                outputs = [completion]
            else:
                outputs = [parent.latest[i] for i in sorted(parent.latest)]
        return RequestOutput(
            request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=outputs, finished=all_done,
            metrics=state.metrics, num_cached_tokens=state.num_cached_tokens,
        )


_NO_TEXT = TokenDecoder(None)
_token_ids = operator.attrgetter("token_ids")
_metrics = operator.attrgetter("metrics")
_wants_logprobs = operator.attrgetter("wants_logprobs")
_works_each_step = operator.attrgetter("works_each_step")
