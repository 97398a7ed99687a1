"""What the executor returns to the core, and what the core returns to the engine."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


@dataclasses.dataclass
class LogprobsLists:
    """Top-k logprobs: row i of a step's logprobs belongs to ModelRunnerOutput.req_ids[i].

    token_ids[i] / logprobs[i] hold the sampled token first, then the top-k; ranks[i] is the
    sampled token's rank (1 = most likely) in the unfiltered distribution.
    """

    token_ids: np.ndarray  # [N, 1 + k] int
    logprobs: np.ndarray  # [N, 1 + k] float
    ranks: np.ndarray  # [N] int
    # Speculative decoding: request i's rows are [cu[i], cu[i + 1]) (one per generated token);
    # None: one row per request.
    cu_num_generated_tokens: np.ndarray | None = None

    def slice_request(self, i: int, num_tokens: int) -> "LogprobsLists":
        """Request i's rows for its first num_tokens generated tokens."""
        start = i if self.cu_num_generated_tokens is None else int(self.cu_num_generated_tokens[i])
        stop = start + num_tokens
        return LogprobsLists(self.token_ids[start:stop], self.logprobs[start:stop], self.ranks[start:stop])


@dataclasses.dataclass
class ModelRunnerOutput:
    # Requests of the step, in the runner's order, and each one's index in that order.
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Per request (req_ids order): tokens sampled this step ([] while a prompt is being prefilled).
    sampled_token_ids: list[list[int]]
    # One row per request, req_ids order (zeros for requests that sampled nothing this step).
    logprobs: LogprobsLists | None = None
    # req_id -> prompt logprobs of the positions computed this step (same layout as logprobs).
    prompt_logprobs: dict[str, LogprobsLists] = dataclasses.field(default_factory=dict)
    # req_id -> why that request's host-side work failed this step: it finishes with an error
    # alone (FinishReason.ERROR) while the rest of the batch goes on.
    failed_req_ids: dict[str, str] = dataclasses.field(default_factory=dict)
    # Requests whose structured-output grammar accepts nothing more after this step's token:
    # the scheduler finishes them with "stop" (before ignore_eos, min_tokens and the length cap).
    grammar_terminated_req_ids: set[str] = dataclasses.field(default_factory=set)
    # Speculative decoding: per request (req_ids order), the tokens drafted for its next step
    # (None when the runner proposed nothing).
    spec_token_ids: list[list[int]] | None = None

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # failed inside the engine (vLLM's name); the engine goes on

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request (vLLM's stop_reason), else None.
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    # When the core first scheduled the request (time.time()); vLLM's SCHEDULED event.
    scheduled_ts: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
