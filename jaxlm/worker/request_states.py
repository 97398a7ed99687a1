"""RequestStates: the runner's host-side state of its requests, kept across steps.

The persistent input rows (InputBatch), the sampler's per-request rows (SamplingInputBuilder),
prompt-logprobs progress, grammar matchers, and the requests whose sampling inputs could not be
built. The runner applies each SchedulerOutput to it before a step is dispatched; a StepHandle
writes the step's tokens back into it when they return. Both hold this object, so neither
needs the other (the runner creates handles; a handle never reaches back into the runner).
"""

from __future__ import annotations

import logging
from typing import Any

from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sampling_params import SamplingParams
from jaxlm.worker.grammar_rows import GrammarRows
from jaxlm.worker.input_batch import InputBatch
from jaxlm.worker.prompt_logprobs import PromptLogprobsTracker

logger = logging.getLogger(__name__)


class RequestStates:
    def __init__(self, input_batch: InputBatch, sampling: SamplingInputBuilder, lora: Any = None) -> None:
        self.input_batch = input_batch
        self.sampling = sampling
        self.lora = lora  # the LoRASlotManager (jaxlm/lora/slots.py), when adapters are served
        self.prompt_logprobs = PromptLogprobsTracker()
        # Its manager is set by the engine before the first constrained request.
        self.grammars = GrammarRows()
        # req_id -> error text, for requests that fail alone (reported in the step's output).
        self._failed: dict[str, str] = {}

    def update(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's view: drop what finished or was preempted, add what is new."""
        for req_id in self.input_batch.update_states(so):  # finished or preempted
            self.sampling.remove_request(req_id)
            if self.lora is not None:
                self.lora.remove_request(req_id)
        for req_id in so.finished_req_ids:
            # Only a finish forgets what was delivered: a preempted request resumes from there.
            self.prompt_logprobs.finish_request(req_id)
            self.grammars.finish_request(req_id)
        for new in so.scheduled_new_reqs:
            self.sampling.remove_request(new.req_id)
            self._add_sampling_request(new)
            if self.lora is not None and (error := self.lora.add_request(new.req_id, new.lora_request)):
                self._failed[new.req_id] = error  # its adapter cannot be read: it fails alone
            if new.sampling_params.structured_outputs is not None:
                self.grammars.add_request(new.req_id, new.sampling_params.structured_outputs, new.output_token_ids)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprobs.add_request(new.req_id, len(new.prompt_token_ids))

    # ---- fault containment: a request whose host-side sampling state cannot be built fails
    # alone (the scheduler finishes it with FinishReason.ERROR); the batch goes on.

    def _add_sampling_request(self, new: Any) -> None:
        try:
            self.sampling.add_request(new.req_id, new.sampling_params, new.prompt_token_ids, new.output_token_ids)
        except Exception as e:  # noqa: BLE001 - attributed to this request only
            logger.exception("request %s: building its sampling inputs failed", new.req_id)
            self._failed[new.req_id] = f"{type(e).__name__}: {e}"
            # A neutral greedy stand-in keeps the batch's shapes; its token is never used.
            self.sampling.add_request(new.req_id, SamplingParams(temperature=0.0, max_tokens=1), (), ())

    def fail(self, errors: dict[str, str]) -> None:
        """Requests that fail alone (req_id -> why), reported with the step's output."""
        self._failed.update(errors)

    def take_failed(self, req_ids: list[str]) -> dict[str, str]:
        """The failures of these requests not reported yet (each is reported once)."""
        if not self._failed:
            return {}
        return {r: self._failed.pop(r) for r in req_ids if r in self._failed}
