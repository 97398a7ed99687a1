"""The only things that cross from the core into the executor, and back."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (recompute feeds them again); [] for a new request.
    output_token_ids: list[int]
    sampling_params: Any  # jaxlm.SamplingParams
    block_ids: list[int]
    # Tokens whose K/V are already in the cache (prefix-cache hits).
    num_computed_tokens: int
    lora_request: Any = None  # jaxlm.lora.LoRARequest, or None for the base model
    # Its images (jaxlm.multimodal.inputs.MultiModalFeatureSpec): the runner encodes them.
    mm_features: list[Any] | None = None


@dataclasses.dataclass
class CachedRequestData:
    """Requests the runner already holds; parallel lists indexed like req_ids."""

    req_ids: list[str] = dataclasses.field(default_factory=list)
    # Blocks appended to the request's block table since the last step.
    new_block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)

    def remove(self, req_id: str) -> None:
        """Takes a request back out of this step (the scheduler preempted it after scheduling it)."""
        i = self.req_ids.index(req_id)
        for column in (self.req_ids, self.new_block_ids, self.num_computed_tokens):
            del column[i]


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens of that request computed in this step (prefill chunk or 1 for decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished/aborted/preempted since the last step: the runner drops their state.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = dataclasses.field(default_factory=set)
    # Speculative decoding (vLLM's name): req_id -> the draft tokens verified this step; that
    # request's num_scheduled_tokens counts them (1 + len(drafts)).
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # Whether the runner proposes drafts after this step (the step speculates: it runs synchronously).
    propose_draft_tokens: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
