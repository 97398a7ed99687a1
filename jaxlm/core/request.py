"""Request: the core's view of one sequence (vLLM v1 names)."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from jaxlm.core.kv_cache_utils import BlockHash
from jaxlm.core.outputs import FinishReason


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a failure traced to this request alone

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # jaxlm.SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = dataclasses.field(default_factory=time.time)
    # --scheduling-policy priority: lower runs first (ties by arrival); 0 under fcfs.
    priority: int = 0

    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    # prompt + output; what the KV cache holds (or will hold) for this sequence.
    all_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Tokens whose K/V are in the cache (prefix hits + computed chunks).
    num_computed_tokens: int = 0
    # Prefix-cache hit length at first scheduling; -1 until then.
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # First time the scheduler admitted it (time.time()); resumes after preemption keep it.
    scheduled_ts: float | None = None
    # Async scheduling: tokens sampled by steps in flight, not yet appended (AsyncScheduler).
    num_output_placeholders: int = 0
    # Speculative decoding: tokens the proposer drafted after the last step (core/spec_decode.py).
    spec_token_ids: list[int] = dataclasses.field(default_factory=list, repr=False)
    # Filled by add_request: max_tokens (None in the params = up to max_model_len).
    max_tokens: int | None = None
    # Chained hashes of the full blocks seen so far (extended lazily by the KVCacheManager).
    block_hashes: list[BlockHash] = dataclasses.field(default_factory=list, repr=False)
    # Tokens that end the request (eos excluded: it is checked unless ignore_eos): the
    # SamplingParams' stop_token_ids as the InputProcessor resolved them.
    stop_token_ids: frozenset[int] = dataclasses.field(default_factory=frozenset, repr=False)
    lora_request: Any = None  # jaxlm.lora.LoRARequest, or None for the base model
    # Its images (jaxlm.multimodal.inputs.MultiModalFeatureSpec), in prompt order; None: text only.
    mm_features: list[Any] | None = None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.all_token_ids:
            self.all_token_ids = self.prompt_token_ids + list(self.output_token_ids)
        if self.sampling_params is not None:
            if self.max_tokens is None:
                self.max_tokens = self.sampling_params.max_tokens
            if not self.stop_token_ids:
                self.stop_token_ids = frozenset(self.sampling_params.stop_token_ids or ())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)
