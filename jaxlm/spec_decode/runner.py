"""SpecModelRunner: the ModelRunner of an engine with a speculative_config.

The verify step is an ordinary step: a request with k drafts has 1 + k scheduled tokens in the
flat token batch (the drafts are written past its known tokens in the input batch), so it runs
the same body programs, bucketed by token count as always. Each of those positions is a sampled
row (InputBatch.prepare_inputs gathers all of them), so the sampler's sequence buckets reach
max_sampled_rows instead of max_num_seqs, and every sampler program is the rejection sampler
(its draft inputs are neutral on rows without drafts). No program exists per k or per request:
the count stays a sum over the bucket lists (plus the draft model's, which are its own buckets).
After the step, the proposer drafts for the requests that sampled (SpecStepHandle).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import jax
from flax import nnx

from jaxlm.config import EngineConfig
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.sample.metadata import HostArrays
from jaxlm.spec_decode.ngram_proposer import NgramProposer
from jaxlm.spec_decode.rejection_sampler import rejection_sample
from jaxlm.spec_decode.step_handle import SpecStepHandle
from jaxlm.worker.buckets import pick_bucket
from jaxlm.worker.input_batch import StepInputs
from jaxlm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class SpecModelRunner(ModelRunner):
    sampler_fn = staticmethod(rejection_sample)

    def __init__(self, config: EngineConfig, model: nnx.Module, mesh: jax.sharding.Mesh | None = None,
                 draft_model: nnx.Module | None = None, draft_mesh: jax.sharding.Mesh | None = None):
        super().__init__(config, model, mesh)
        spec = config.speculative_config
        self.speculative_config = spec
        self.drafter: Any = None
        if spec.uses_draft_model:
            from jaxlm.spec_decode.draft_model import DraftModelRunner

            self.drafter = DraftModelRunner(config, draft_model, draft_mesh or mesh, self)
        else:
            self.ngram = NgramProposer(spec, self.max_model_len)
        # The drafts verified by the step being dispatched, and whether to propose after it.
        self._step_drafts: dict[str, list[int]] = {}
        self.propose_after_step = False

    # ---- the draft model rides along: its KV cache, warm-up and a body per step ----------------

    def initialize_kv_cache(self, num_blocks: int, dtype: Any) -> None:
        super().initialize_kv_cache(num_blocks, dtype)
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, dtype)

    def compile_jobs(self) -> list:
        """The draft model's programs compile under the same progress bar, counted in num_programs."""
        jobs = super().compile_jobs()
        if self.drafter is not None:
            draft_jobs = self.drafter.compile_jobs()
            self.drafter.num_programs = len(draft_jobs)
            jobs += draft_jobs
        return jobs

    def _run_body(self, so: SchedulerOutput):
        prev_tokens = self._last_tokens  # the draft's body reads the same device tokens
        result = super()._run_body(so)
        if self.drafter is not None:
            self.drafter.mirror(result[0], prev_tokens)
        return result

    # ---- the verify step's rows and the proposals ------------------------------------------------

    def _dispatch(self, so: SchedulerOutput) -> Any:
        self._step_drafts = so.scheduled_spec_decode_tokens
        self.propose_after_step = so.propose_draft_tokens
        return super()._dispatch(so)

    def _make_handle(self, inputs: StepInputs, out: Any, placed: Any, prompt_rows: Any) -> SpecStepHandle:
        return SpecStepHandle(self.states, inputs, out, placed, prompt_rows, self.step_timer,
                              propose=self.propose_drafts if self.propose_after_step else None)

    def _sampling_inputs(self, inputs: StepInputs) -> HostArrays | None:
        if inputs.num_sample_rows is None:
            return super()._sampling_inputs(inputs)
        req_ids = inputs.sample_req_ids
        S = pick_bucket(inputs.num_sampled_rows, self.seq_buckets)
        drafts = [self._step_drafts.get(r, ()) for r in req_ids]
        return self.sampling.build_host(req_ids, S, self.sampling.variant_of(req_ids), drafts)

    def propose_drafts(self, req_ids: list[str]) -> dict[str, list[int]]:
        """Drafts for these requests (those that sampled this step and still hold their rows).
        Under the compile guard: the async driver asks for them outside execute_model."""
        batch = self.input_batch
        req_ids = [r for r in req_ids if r in batch.req_id_to_row]
        if not req_ids:
            return {}
        rows = list(map(batch.req_id_to_row.__getitem__, req_ids))
        guard = self.compile_guard
        with contextlib.nullcontext() if guard.in_step else guard.step():
            if self.drafter is not None:
                drafts = self.drafter.propose(rows)
            else:
                drafts = self.ngram.propose(batch.token_ids[rows], batch.num_tokens[rows])
        return dict(zip(req_ids, drafts))
