"""RequestOutput / CompletionOutput: what LLM.generate returns and the server streams (vLLM's shape)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token_id: Logprob} holding the top-N and the chosen token.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestStateStats:
    """One sequence's timestamps (time.time() seconds), vLLM's names: arrival (the server got it,
    before tokenization), queued (the engine took it), scheduled (first scheduled), first and
    last token. /metrics derives its queue, prefill, decode and inference times from them."""

    arrival_time: float
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    num_generation_tokens: int = 0
    # first_token_ts - arrival_time (TTFT), set with first_token_ts.
    first_token_latency: float | None = None
    # The engine core serving it (data parallel: 0 .. N-1), /metrics' `engine` label.
    engine_index: int = 0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestStateStats | None = None
    num_cached_tokens: int = 0
