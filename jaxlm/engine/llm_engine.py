"""LLMEngine: requests' life — add, step, abort, stream — over the core and an executor."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Iterable

from jaxlm.core.scheduler import Scheduler
from jaxlm.core.stats import merge_scheduler_stats
from jaxlm.engine.core import EngineCore
from jaxlm.engine.core_client import EngineCoreClient, InprocClient, prepare_frontend_process
from jaxlm.engine.engine_stats import FrontendStats
from jaxlm.engine.messages import EngineCoreRejection, EngineCoreRequest
from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.exceptions import QueueFullError
from jaxlm.engine.generation_config import (
    generation_eos_token_ids, get_diff_sampling_param, try_get_generation_config)
from jaxlm.engine.input_processor import (
    InputProcessor, InvalidRequestError, PromptType, ProcessedPrompt, make_internal_request_id)
from jaxlm.engine.output_processor import OutputProcessor, ParentRequest
from jaxlm.engine.stat_logger import LoggingStatLogger
from jaxlm.executor.abstract import Executor
from jaxlm.executor.distributed import init_distributed
from jaxlm.lora.checker import LoRAChecker
from jaxlm.config import EngineConfig
from jaxlm.model_loader import get_tokenizer, resolve_model_config
from jaxlm.core.outputs import FinishReason
from jaxlm.outputs import CompletionOutput, RequestOutput
from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sampling_params import SamplingParams
from jaxlm.spec_decode.setup import resolve_speculative_config
from jaxlm.worker.bucket_planner import resolve_auto_buckets
from jaxlm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def _model_eos_token_id(hf_config: Any) -> int | None:
    """The model config's eos id when no tokenizer is loaded (the first, if it lists several)."""
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def _mm_processor(mc: Any) -> Any:
    """The image preprocessing of a multimodal model (None: a text-only model)."""
    from jaxlm.models.registry import is_multimodal_config

    if not is_multimodal_config(mc.hf_config):
        return None
    from jaxlm.multimodal.processing import MultiModalProcessor

    return MultiModalProcessor(mc.model, mc.hf_config, mc.limit_mm_per_prompt,
                               mc.allowed_local_media_path, mc.mm_processor_kwargs)


class LLMEngine:
    """The front end: input processing, output processing (detokenization) and an engine-core
    client; the scheduler and the executor live in the core (this process or a child)."""

    def __init__(self, config: EngineConfig, *, multiprocess: bool = False, core_launcher: Any = None):
        self.engine_config = config
        init_distributed(config.parallel_config)  # several nodes: before anything touches a backend
        if config.parallel_config.nnodes > 1:
            if config.parallel_config.data_parallel_size > 1:
                raise ValueError(f"data_parallel_size={config.parallel_config.data_parallel_size} with "
                                 f"nnodes={config.parallel_config.nnodes}: data-parallel cores on several "
                                 "nodes are not supported yet")
            # Rank 0 of the global mesh is this process: its core runs here, not in a child.
            multiprocess = False
        core_env = prepare_frontend_process() if multiprocess else None
        mc = config.model_config = resolve_model_config(config.model_config, config.load_config)
        config.scheduler_config.max_model_len = mc.max_model_len
        self.model_config = mc
        # skip_tokenizer_init: token ids in and out; text-dependent fields are refused at admission.
        self.tokenizer = None if mc.skip_tokenizer_init else get_tokenizer(mc)
        resolve_auto_buckets(config, self.tokenizer)  # --token-buckets auto: before any compile
        resolve_speculative_config(config, self.tokenizer)  # the draft model's config, its tokenizer checked
        vocab = int(mc.hf_config.vocab_size)
        self.eos_token_id = (self.tokenizer.eos_token_id if self.tokenizer is not None
                             else _model_eos_token_id(mc.hf_config))
        generation_config = try_get_generation_config(mc)
        self.default_sampling_params = get_diff_sampling_param(mc, generation_config)
        if self.default_sampling_params:
            try:
                SamplingParams(**self.default_sampling_params)  # fail at start-up, not per request
            except (TypeError, ValueError) as e:
                raise ValueError(f"Bad sampling defaults in the generation config: {e}") from e
            logger.info("Default sampling parameters from the model's generation config: %s "
                        "(request fields override them; --generation-config vllm ignores them)",
                        self.default_sampling_params)
        # Admission asks the sampler what it can honour; the runner's builder has the same limits.
        checker = SamplingInputBuilder(vocab, mc.max_model_len, max_logprobs=mc.max_logprobs)
        self.input_processor = InputProcessor(
            self.tokenizer, mc.max_model_len, vocab, self.eos_token_id,
            generation_eos_token_ids(generation_config, mc.hf_config), checker.check_params,
            self.get_structured_output_manager, scheduling_policy=config.scheduler_config.scheduling_policy,
            mm_processor=_mm_processor(mc), model_name=f"The model {mc.model}")
        self._structured_output_manager: StructuredOutputManager | None = None
        self.lora_checker = LoRAChecker(mc, config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Builds (and warms up) the core(s): in this process, or engine-core processes.
        self.engine_core = EngineCoreClient.make_client(config, multiprocess, core_env, core_launcher)
        # Internal ids (client id + serial) of unfinished requests.
        self._live_ids: set[str] = set()
        self._serial = itertools.count()
        # Routing (internal) id -> why it failed: a message for requests finished with
        # FinishReason.ERROR, the exception for adds a core refused.
        self._request_errors: dict[str, str | Exception] = {}
        # Tokens per engine core (/metrics' `engine` label); the periodic stats line unless
        # --disable-log-stats.
        self.frontend_stats = FrontendStats(self.engine_core.num_engines)
        self.stat_logger = None if config.observability_config.disable_log_stats else LoggingStatLogger()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, multiprocess: bool = False,
                         core_launcher: Any = None) -> "LLMEngine":
        """core_launcher: the server's engine-core process, started early (engine/core_launcher.py)."""
        return cls(engine_args.create_engine_config(), multiprocess=multiprocess, core_launcher=core_launcher)

    def _inproc_core(self) -> EngineCore:
        if not isinstance(self.engine_core, InprocClient):
            raise RuntimeError("the engine core runs in another process: its scheduler and runner "
                               "are not reachable from here")
        return self.engine_core.engine_core

    @property
    def has_core_process(self) -> bool:
        """The engine core(s) run in processes of their own: their outputs, and an idle core's
        heartbeat with its fresh stats, arrive through step_routed."""
        return not isinstance(self.engine_core, InprocClient)

    @property
    def scheduler(self) -> Scheduler:
        """The in-process core's scheduler (tests and benches)."""
        return self._inproc_core().scheduler

    @property
    def executor(self) -> Executor:
        return self._inproc_core().executor

    def shutdown(self) -> None:
        """Stops the engine-core processes, if any."""
        self.engine_core.shutdown()

    def wakeup(self) -> None:
        """Ends a step_routed wait early (from another thread): a new command is waiting."""
        self.engine_core.wakeup()

    def check_health(self) -> None:
        """EngineDeadError when an engine core is gone (safe from any thread)."""
        self.engine_core.check_health()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_model_runner(self) -> Any:
        """The in-process ModelRunner (compile guard, bucket and padding counters): tests and benches."""
        return self.executor.get_model_runner()

    def get_structured_output_manager(self) -> StructuredOutputManager:
        """The constraint compiler and matcher factory, shared by admission and the runner.
        Built on first use: llguidance's view of the tokenizer takes ~1 s."""
        if self._structured_output_manager is None:
            ip = self.input_processor
            eos = sorted({ip.eos_token_id, *ip.generation_eos_ids} - {None})
            mgr = StructuredOutputManager(self.tokenizer, ip.vocab_size, eos_token_ids=eos)
            if isinstance(self.engine_core, InprocClient):  # one manager for admission and the runner
                self.get_model_runner().grammars.manager = mgr
            self._structured_output_manager = mgr
        return self._structured_output_manager

    def get_input_processor(self) -> InputProcessor:
        """The one admission path: the server checks prompts with it before queueing them."""
        return self.input_processor

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """SamplingParams fields the model's generation_config.json sets (vLLM's name)."""
        return dict(self.default_sampling_params)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's recommended defaults: what a request that sets no
        sampling field gets (vLLM's LLM.get_default_sampling_params)."""
        return SamplingParams(**self.default_sampling_params)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None, *, internal_request_id: str | None = None,
                    priority: int = 0, lora_request: Any = None) -> str:
        """Validate and queue a request; returns its internal id (abort_request and step_routed
        use it; RequestOutput.request_id stays the client's). Raises ValueError naming the
        problem, QueueFullError past max_num_queued_reqs (nothing queued either way). priority:
        lower runs first under --scheduling-policy priority (its n > 1 sequences share it).
        lora_request: the LoRARequest of the adapter to run it with (None: the base model)."""
        self.input_processor.check_request_id(request_id)
        self.input_processor.check_priority(priority)
        self.lora_checker.check(lora_request)
        internal_id = internal_request_id or make_internal_request_id(request_id, next(self._serial))
        if internal_id in self._live_ids:
            raise InvalidRequestError("request_id", f"Internal request id {internal_id!r} is already in use")
        arrival_time = arrival_time or time.time()
        processed = self.input_processor.process_prompt(prompt)
        params = self.input_processor.process_params(params, len(processed.prompt_token_ids))
        if not isinstance(self.engine_core, InprocClient):
            self._check_queue(params.n)
        children = self._fan_out(internal_id, request_id, params)
        for (child_id, child_params, parent, index) in children:
            self.output_processor.add_request(child_id, request_id, processed.prompt,
                                              processed.prompt_token_ids, child_params, arrival_time,
                                              parent, index)
        # In-process, a refusal (QueueFullError, ValueError) raises here; a core process refuses
        # later (step_routed reports it), so the request's state exists before it is sent.
        try:
            engine_index = self.engine_core.add_request([
                EngineCoreRequest(child_id, processed.prompt_token_ids, child_params, self.eos_token_id, arrival_time,
                                  priority=priority, lora_request=lora_request,
                                  mm_features=processed.mm_features)
                for child_id, child_params, _, _ in children])
        except Exception:
            self.output_processor.abort_requests([internal_id])
            raise
        for child_id, _, _, _ in children:  # the core serving it: /metrics' `engine` label
            self.output_processor.request_states[child_id].metrics.engine_index = engine_index
        self._live_ids.add(internal_id)
        return internal_id

    def _check_queue(self, n: int) -> None:
        """With core processes, the front end's exact view: every open sequence either runs or
        waits in some core (their stats lag). In-process, EngineCore checks each add itself."""
        sched = self.engine_config.scheduler_config
        if sched.max_num_queued_reqs is None:
            return
        num_engines = self.engine_core.num_engines
        live = len(self.output_processor.request_states)
        if live + n - sched.max_num_seqs * num_engines > sched.max_num_queued_reqs * num_engines:
            raise QueueFullError(
                f"The waiting queue is full ({sched.max_num_queued_reqs} requests); try again later")

    @staticmethod
    def _fan_out(internal_id: str, request_id: str, params: SamplingParams):
        if params.n == 1:
            return [(internal_id, params, None, 0)]
        parent = ParentRequest(internal_id, request_id, params.n)
        children = []
        for i in range(params.n):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i  # distinct but reproducible samples
            children.append((f"{i}_{internal_id}", child, parent, i))
        return children

    def abort_request(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """Abort by client id (every live request with it), or by internal id (what add_request
        returned) when internal=True (vLLM's flag); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if not internal:
            ids = self.output_processor.internal_ids_of(ids)
        self._live_ids.difference_update(ids)
        core_ids = self.output_processor.abort_requests(ids)
        if core_ids:
            self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return sum(s.num_running_reqs + s.num_waiting_reqs for s in self.engine_core.get_scheduler_stats())

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        return [out for _, out in self.step_routed()]

    def step_routed(self, timeout: float | None = None) -> list[tuple[str, RequestOutput]]:
        """One engine step (in-process), or the batches the core processes sent within timeout
        seconds: (internal id, output) pairs, the internal id being what add_request returned:
        AsyncLLMEngine routes by it, never by the client's id."""
        routed: list[tuple[str, RequestOutput]] = []
        for batch in self.engine_core.get_output(timeout):
            for core_id, why in batch.failed.items():
                self._note_error(core_id, why)
            for rejection in batch.rejected:
                routed.extend(self._reject(rejection))
            prompt_tokens_done = self.output_processor.num_prompt_tokens_done
            processed = self.output_processor.process_outputs(batch.outputs)
            if len(batch.outputs):  # a step (not an idle core's heartbeat)
                self.frontend_stats.record_step(
                    batch.engine_index, self.output_processor.num_prompt_tokens_done - prompt_tokens_done,
                    len(batch.outputs.new_token_ids))
            if processed.to_abort:  # stop strings end requests the core still thinks are running
                self.engine_core.abort_requests(processed.to_abort)
            routed.extend(processed.routed)
            # A failure in one request's detokenization, stop strings or logprobs fails that
            # request alone (FinishReason.ERROR).
            for core_id, why in processed.failed.items():
                routed.extend(self._fail_request(core_id, why))
        for internal_id, out in routed:
            if out.finished:
                self._live_ids.discard(internal_id)
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(self.get_stats)
        return routed

    def _reject(self, rejection: EngineCoreRejection) -> list[tuple[str, RequestOutput]]:
        """An add a core process refused: its caller gets QueueFullError or ValueError."""
        error: Exception = (QueueFullError(rejection.message) if rejection.queue_full
                            else InvalidRequestError("prompt", rejection.message))
        return self._fail_request(rejection.request_id, error)

    # ---- fault containment ------------------------------------------------------------------

    def pop_request_error(self, internal_id: str) -> str | Exception | None:
        """Why a request that finished with finish_reason "error" failed (once; None if it did
        not): a message, or the exception its caller gets (a core process refused the add)."""
        return self._request_errors.pop(internal_id, None)

    def _routing_id(self, core_id: str) -> str:
        state = self.output_processor.request_states.get(core_id)
        return state.parent.request_id if state is not None and state.parent else core_id

    def _note_error(self, core_id: str, why: str) -> None:
        self._request_errors.setdefault(self._routing_id(core_id), why)

    def _fail_request(self, core_id: str, why: str | Exception) -> list[tuple[str, RequestOutput]]:
        """Ends a request (all of its n children) with FinishReason.ERROR: its KV blocks are
        freed and its caller gets one final output without text."""
        state = self.output_processor.request_states.get(core_id)
        if state is None:
            return []
        routing_id = self._routing_id(core_id)
        self._request_errors.setdefault(routing_id, why)
        core_ids = self.output_processor.abort_requests([routing_id])
        self.engine_core.abort_requests(core_ids)
        self._live_ids.discard(routing_id)
        failed = CompletionOutput(index=state.index, text="", token_ids=[], cumulative_logprob=None,
                                  logprobs=None, finish_reason=str(FinishReason.ERROR))
        external = state.parent.external_req_id if state.parent else state.external_req_id
        return [(routing_id, RequestOutput(
            request_id=external, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None, outputs=[failed], finished=True, metrics=state.metrics))]

    def get_stats(self) -> dict[str, Any]:
        """The totals over the engine cores (vLLM's metric names as keys), and per core its
        SchedulerStats ("engines") and token counters ("engine_tokens"): /metrics' series."""
        stats = self.frontend_stats.get_stats(self.engine_core.get_scheduler_stats())
        lora = self.engine_config.lora_config
        if lora.enable_lora:  # vllm:lora_requests_info: adapters of running / waiting requests
            merged = merge_scheduler_stats(stats["engines"])
            stats["lora"] = {"max_lora": lora.max_loras, "running": merged.running_lora_adapters,
                             "waiting": merged.waiting_lora_adapters}
        return stats
