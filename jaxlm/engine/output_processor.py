"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenize, stop strings, logprobs, n > 1)."""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Any

from jaxlm.core.outputs import EngineCoreOutput, FinishReason, LogprobsLists
from jaxlm.engine.detokenizer import IncrementalDetokenizer
from jaxlm.engine.logprobs import LogprobsProcessor, TokenDecoder
from jaxlm.outputs import CompletionOutput, RequestOutput, RequestStateStats
from jaxlm.sampling_params import RequestOutputKind, SamplingParams


# vllm:iteration_tokens_total bucket bounds (vLLM's).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclasses.dataclass
class IterationTokensStats:
    """Cumulative histogram of the tokens each engine step handled: the prompt tokens of requests
    whose first token came out in it plus its new tokens (vLLM's IterationStats rule). Kept on
    the engine thread, read as a snapshot (the frontend sees steps only through get_stats)."""

    bucket_counts: list[int] = dataclasses.field(
        default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))  # last: +Inf
    sum: int = 0
    count: int = 0

    def observe(self, num_tokens: int) -> None:
        self.bucket_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens
        self.count += 1

    def snapshot(self) -> "IterationTokensStats":
        return IterationTokensStats(list(self.bucket_counts), self.sum, self.count)


@dataclasses.dataclass
class ParentRequest:
    """n > 1: the user's request fans out into n child requests sharing the prompt."""

    request_id: str  # internal (client id + suffix): the key outputs are routed by
    external_req_id: str  # the client's: what RequestOutput.request_id shows
    n: int
    latest: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)
    finished: set[int] = dataclasses.field(default_factory=set)


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
        self.logprobs = LogprobsProcessor(tokenizer, params, token_decoder)
        self.token_ids: list[int] = []
        self.sent_tokens = 0
        self.metrics = RequestStateStats(arrival_time=arrival_time, queued_ts=time.time())
        self.num_cached_tokens = 0

    def completion(self, finish_reason: str | None, stop_reason: Any, delta: bool) -> CompletionOutput:
        finished = finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta) if self.detokenizer else ""
        start = self.sent_tokens if delta else 0
        token_ids = self.token_ids[start:]
        logprobs = self.logprobs.logprobs
        if logprobs is not None and delta:
            logprobs = logprobs[start:]
        self.sent_tokens = len(self.token_ids)
        return CompletionOutput(
            index=self.index, text=text, token_ids=list(token_ids),
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
        self.iteration_tokens = IterationTokensStats()

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

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[tuple[str, RequestOutput]], list[str]]:
        """Returns ((internal id, output) pairs to hand to the callers, core ids to abort: stop
        strings). The internal id is the parent's for n > 1."""
        now = time.time()
        request_outputs: list[tuple[str, RequestOutput]] = []
        to_abort: list[str] = []
        prompt_tokens_done = self.num_prompt_tokens_done
        for out in outputs:
            state = self.request_states.get(out.req_id)
            if state is None:  # aborted meanwhile
                continue
            self._update_stats(state.metrics, out, len(state.prompt_token_ids), now)
            state.num_cached_tokens = out.num_cached_tokens
            new_ids, new_logprobs = out.new_token_ids, out.new_logprobs
            finish_reason = str(out.finish_reason) if out.finish_reason else None
            stop_reason = out.stop_reason
            if state.detokenizer is not None and new_ids:
                # A stop token (eos / stop_token_ids) that ended the request is not shown as text;
                # a request a grammar ended with "stop" ends on an ordinary token.
                stop_terminated = (out.finish_reason == FinishReason.STOP
                                   and new_ids[-1] in state.params.all_stop_token_ids)
                stop_str = state.detokenizer.update(new_ids, stop_terminated=stop_terminated)
                if stop_str is not None and finish_reason is None:
                    finish_reason, stop_reason = str(FinishReason.STOP), stop_str
                    to_abort.append(out.req_id)
                if stop_str is not None and state.detokenizer.tokens_past_stop:  # several tokens a step
                    new_ids, new_logprobs = _up_to_stop(new_ids, new_logprobs, state.detokenizer.tokens_past_stop)
            state.token_ids.extend(new_ids)
            state.logprobs.update_from_output(new_logprobs, out.new_prompt_logprobs)
            if finish_reason is not None:
                del self.request_states[out.req_id]
            ro = self._make_output(state, finish_reason, stop_reason)
            if ro is not None:
                request_outputs.append((state.parent.request_id if state.parent else state.request_id, ro))
        self.iteration_tokens.observe(self.num_prompt_tokens_done - prompt_tokens_done
                                      + sum(len(o.new_token_ids) for o in outputs))
        return request_outputs, to_abort

    def _update_stats(self, m: RequestStateStats, out: EngineCoreOutput, prompt_len: int, now: float) -> None:
        if m.scheduled_ts is None:
            m.scheduled_ts = out.scheduled_ts
        if out.new_token_ids:
            if m.first_token_ts is None:
                m.first_token_ts = now
                m.first_token_latency = now - m.arrival_time
                self.num_prompt_tokens_done += prompt_len
            m.last_token_ts = now
            m.num_generation_tokens += len(out.new_token_ids)

    def _make_output(self, state: RequestState, finish_reason: str | None, stop_reason: Any) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
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


def _up_to_stop(token_ids: list[int], logprobs: LogprobsLists | None,
                num_past: int) -> tuple[list[int], LogprobsLists | None]:
    """A step's tokens (and logprob rows) up to the one that completed a stop string."""
    keep = len(token_ids) - num_past
    return token_ids[:keep], None if logprobs is None else logprobs.slice_request(0, keep)
