"""EngineCore: the scheduler and the executor, stepped by a driver (vLLM's names).

The front end (LLMEngine / AsyncLLMEngine) keeps tokenization, the output processor and
detokenization; the core sees token ids only. It runs in the caller's process (InprocClient)
or in a child process of its own (EngineCoreProc, driven by the multiprocess clients)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.util
import os
import signal
import sys
import time
from typing import Any, Iterable

from jaxlm.config import EngineConfig
from jaxlm.core.async_scheduler import AsyncScheduler
from jaxlm.core.outputs import EngineCoreOutputBatch
from jaxlm.core.request import Request, RequestStatus
from jaxlm.core.scheduler import Scheduler
from jaxlm.core.stats import SchedulerStats
from jaxlm.engine.async_scheduling import AsyncStepDriver
from jaxlm.engine.exceptions import QueueFullError
from jaxlm.engine.messages import (
    MSG_FAILED, MSG_OUTPUTS, MSG_READY, EngineCoreOutputs, EngineCoreReady, EngineCoreRejection,
    EngineCoreRequest, EngineCoreRequestType, MsgpackDecoder, MsgpackEncoder)
from jaxlm.executor.abstract import Executor

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def async_scheduling_blocker(config: EngineConfig) -> str | None:
    """Why async scheduling cannot run with this config, or None. It feeds decode rows from the
    previous step's tokens on the device: the pipeline runner's stages and the multi-host step
    broadcast do not (yet), and --token-buckets auto planned its buckets on the synchronous loop."""
    parallel = config.parallel_config
    for name in ("pipeline_parallel_size", "nnodes"):
        if getattr(parallel, name) > 1:
            return f"{name}={getattr(parallel, name)}"
    if config.compilation_config.workload is not None:
        return "--token-buckets auto (buckets planned on the synchronous step loop)"
    spec = config.speculative_config
    if spec is not None and spec.uses_draft_model and spec.draft_tensor_parallel_size not in (
            None, parallel.tensor_parallel_size):
        return "a draft model on another mesh than the target's (draft_tensor_parallel_size=1)"
    return None


def _whole_images_per_step(config: EngineConfig) -> None:
    """A model whose image tokens attend to each other (Gemma 3: ``bidirectional_mm_items``)
    prefills each image in one step: vLLM's disable_chunked_mm_input, which needs a step's
    token budget to hold an image."""
    from jaxlm.models.registry import get_model_architecture, is_multimodal_config

    hf_config = config.model_config.hf_config
    if not is_multimodal_config(hf_config) or not getattr(get_model_architecture(hf_config),
                                                           "bidirectional_mm_items", False):
        return
    sched = config.scheduler_config
    per_image = int(getattr(hf_config, "mm_tokens_per_image", 0) or 0)
    if sched.max_num_batched_tokens < per_image:
        raise ValueError(f"max_num_batched_tokens={sched.max_num_batched_tokens} cannot hold one image's "
                         f"{per_image} tokens, which this model prefills in one step (its image tokens attend "
                         "to each other): raise --max-num-batched-tokens")
    sched.disable_chunked_mm_input = True


class EngineCore:
    """One scheduler over one executor (its own devices and KV cache)."""

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        self.engine_config = config
        self.engine_index = engine_index
        _whole_images_per_step(config)
        self.executor = Executor.get_class(config)(config)
        try:
            self._initialize_kv_cache(config)
        except BaseException:  # the weights are loaded already: give them back before raising
            self.executor.shutdown()
            raise
        # --async-scheduling: the driver dispatches step N+1 before it hands step N's output
        # back (engine/async_scheduling.py); otherwise the plain schedule -> execute -> update.
        blocker = async_scheduling_blocker(config) if config.scheduler_config.async_scheduling else None
        if blocker is not None:
            logger.info("async scheduling off: it does not run with %s yet", blocker)
        spec = config.speculative_config
        if config.scheduler_config.async_scheduling and blocker is None:
            self.scheduler: Scheduler = AsyncScheduler(config.scheduler_config, config.cache_config,
                                                       config.lora_config, spec)
            self._async_driver: AsyncStepDriver | None = AsyncStepDriver(self.scheduler, self.executor)
            if spec is not None:
                logger.info("async scheduling: steps that speculate (%s) run synchronously; steps above "
                            "disable_by_batch_size=%s overlap", spec.method, spec.disable_by_batch_size)
        else:
            self.scheduler = Scheduler(config.scheduler_config, config.cache_config, config.lora_config, spec)
            self._async_driver = None
        # first child id -> siblings not yet handed to the scheduler (n > 1)
        self._deferred: dict[str, list[Request]] = {}
        self._structured_output_ready = False

    def _initialize_kv_cache(self, config: EngineConfig) -> None:
        num_blocks = self.executor.determine_num_available_blocks()
        capacity = num_blocks * config.cache_config.block_size
        max_model_len = config.model_config.max_model_len
        if capacity < max_model_len:
            raise ValueError(
                f"The model's max seq len ({max_model_len}) is larger than the maximum number of tokens "
                f"that can be stored in KV cache ({capacity}). Increase the KV cache memory "
                "(--kv-cache-memory-bytes, --num-gpu-blocks-override) or decrease --max-model-len.")
        config.cache_config.num_gpu_blocks = num_blocks
        self.executor.initialize_cache(num_blocks)

    def add_request(self, requests: list[EngineCoreRequest]) -> None:
        """Queue one user request: its n sequences, the first one first. Raises ValueError
        naming the problem, QueueFullError past max_num_queued_reqs (nothing queued either way)."""
        self._check_queue(len(requests))
        if not self._structured_output_ready and requests[0].sampling_params.structured_outputs is not None:
            self._init_structured_output()
        core_requests = [Request(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                 sampling_params=r.sampling_params, eos_token_id=r.eos_token_id,
                                 arrival_time=r.arrival_time, priority=r.priority,
                                 lora_request=r.lora_request, mm_features=r.mm_features) for r in requests]
        # n > 1: siblings wait until the first child's prompt is in the cache, then reuse its
        # blocks through the prefix cache instead of each prefilling its own copy.
        self.scheduler.add_request(core_requests[0])
        if len(core_requests) > 1:
            self._deferred[core_requests[0].request_id] = core_requests[1:]

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish these sequences (unknown ids are ignored)."""
        request_ids = list(request_ids)
        for req_id in request_ids:
            self._deferred.pop(req_id, None)
        deferred = {r.request_id for siblings in self._deferred.values() for r in siblings}
        if deferred.intersection(request_ids):
            drop = set(request_ids)
            for first, siblings in list(self._deferred.items()):
                self._deferred[first] = [r for r in siblings if r.request_id not in drop]
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        in_flight = self._async_driver is not None and self._async_driver.has_in_flight()
        return self.scheduler.has_unfinished_requests() or bool(self._deferred) or in_flight

    def step(self) -> EngineCoreOutputs:
        """One engine step: schedule -> execute -> update; the outputs and the stats after it."""
        failed: dict[str, str] = {}

        def update(scheduler_output, runner_output) -> EngineCoreOutputBatch:
            failed.update(runner_output.failed_req_ids)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            if self._deferred:
                self._release_siblings(outputs)
            return outputs

        if self._async_driver is not None:
            outputs = EngineCoreOutputBatch.concat(self._async_driver.step(update) or [EngineCoreOutputBatch()])
        else:
            scheduler_output = self.scheduler.schedule()
            outputs = update(scheduler_output, self.executor.execute_model(scheduler_output))
        return EngineCoreOutputs(engine_index=self.engine_index, outputs=outputs, failed=failed,
                                 scheduler_stats=self.make_stats())

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        """Frees the executor's device memory; the core serves no step after it."""
        if self._async_driver is not None:
            self._async_driver = None  # its in-flight step's buffers are deleted below
        self.executor.shutdown()

    def _check_queue(self, n: int) -> None:
        """Refuse past max_num_queued_reqs. Only sequences that would have to wait count (none
        while running slots are free), and a request's n counts as n requests."""
        sched = self.engine_config.scheduler_config
        if sched.max_num_queued_reqs is None:
            return
        stats = self.scheduler.make_stats()
        unscheduled = stats.num_waiting_reqs + sum(len(s) for s in self._deferred.values())
        would_wait = stats.num_running_reqs + unscheduled + n - sched.max_num_seqs
        if would_wait > sched.max_num_queued_reqs:
            raise QueueFullError(
                f"The waiting queue is full ({sched.max_num_queued_reqs} requests); try again later")

    def _release_siblings(self, outputs: EngineCoreOutputBatch) -> None:
        index = dict(zip(outputs.req_ids, range(len(outputs))))
        for first in [r for r in self._deferred if r in index]:
            i = index[first]
            if outputs.num_new_tokens[i] or i in outputs.finish_reasons:
                for sibling in self._deferred.pop(first):
                    self.scheduler.add_request(sibling)

    def _init_structured_output(self) -> None:
        """The runner's grammar matchers: built on the first constrained request (llguidance's
        view of the tokenizer takes ~1 s)."""
        from jaxlm.engine.generation_config import generation_eos_token_ids, try_get_generation_config
        from jaxlm.model_loader import get_tokenizer
        from jaxlm.structured_output.manager import StructuredOutputManager

        runner = self.executor.get_model_runner()
        if runner.grammars.manager is None:
            mc = self.engine_config.model_config
            tokenizer = get_tokenizer(mc)
            eos = generation_eos_token_ids(try_get_generation_config(mc), mc.hf_config)
            eos = sorted((eos | {tokenizer.eos_token_id}) - {None})
            runner.grammars.manager = StructuredOutputManager(
                tokenizer, int(mc.hf_config.vocab_size), eos_token_ids=eos)
        self._structured_output_ready = True


class EngineCoreProc:
    """An EngineCore in a child process: a busy loop that takes adds and aborts off its input
    socket, steps while there is work, and pushes each step's outputs (with the core's load and
    stats) to the front end. Startup ends with a handshake after warm-up; the parent owns the
    lifecycle (SIGINT/SIGTERM go to it; the core exits on SHUTDOWN or when the parent dies)."""

    # An idle core still reports this often: the front end tells silence from death.
    HEARTBEAT_S = 1.0

    def __init__(self, core: EngineCore, input_socket: Any, output_socket: Any, parent_pid: int) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.encoder = MsgpackEncoder()
        self.add_decoder = MsgpackDecoder(list[EngineCoreRequest])
        self.abort_decoder = MsgpackDecoder(list[str])
        self.num_adds_seen = 0
        self._rejected: list[EngineCoreRejection] = []
        self._shutdown = False

    @staticmethod
    def run_engine_core(config: EngineConfig, engine_index: int, input_addr: str, output_addr: str,
                        parent_pid: int, env: dict[str, str | None]) -> None:
        """The child process's entry point (multiprocessing 'spawn': jax is not fork-safe). env:
        variables to set (None: unset) before jax starts, e.g. this core's share of the devices."""
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains, then sends SHUTDOWN
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        logging.basicConfig(level=logging.INFO,
                            format=f"(EngineCore_{engine_index} pid={os.getpid()}) %(levelname)s %(name)s: %(message)s")
        import zmq

        ctx = zmq.Context()
        output_socket = ctx.socket(zmq.PUSH)
        output_socket.connect(output_addr)
        input_socket = ctx.socket(zmq.PULL)
        input_socket.connect(input_addr)
        encoder = MsgpackEncoder()
        try:
            core = EngineCore(config, engine_index)
        except BaseException as e:  # noqa: BLE001 - told to the front end, which raises it
            logger.exception("engine core %d failed to start", engine_index)
            output_socket.send_multipart([MSG_FAILED, encoder.encode((engine_index, type(e).__name__, str(e)))])
            _flush_and_close(ctx, output_socket, input_socket)
            sys.exit(1)
        ready = EngineCoreReady(engine_index, int(config.cache_config.num_gpu_blocks),
                                int(config.model_config.weight_bytes or 0))
        output_socket.send_multipart([MSG_READY, encoder.encode(ready)])
        proc = EngineCoreProc(core, input_socket, output_socket, parent_pid)
        try:
            proc.run_busy_loop()
        except BaseException as e:  # noqa: BLE001 - the front end fails every open request with it
            logger.exception("engine core %d died", engine_index)
            proc.send(EngineCoreOutputs(engine_index, engine_dead=f"{type(e).__name__}: {e}"))
            _flush_and_close(ctx, output_socket, input_socket)
            _exit(core, 1)
        _flush_and_close(ctx, output_socket, input_socket, linger_ms=1000)
        _exit(core, 0)

    def run_busy_loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        last_sent = 0.0
        deferred = True  # programs a warm start left to load (defer_program_load)
        while not self._shutdown:
            if os.getppid() != self.parent_pid:
                logger.error("the front end is gone: engine core %d exits", self.core.engine_index)
                return
            busy = self.core.has_unfinished_requests()
            changed = False
            if poller.poll(0 if busy or deferred else int(self.HEARTBEAT_S * 1000)):
                changed = self._process_input()
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
            elif deferred and not changed:
                # Idle: load one program now rather than on a request's first step that needs it.
                deferred = self.core.executor.load_deferred_program()
                if time.monotonic() - last_sent < self.HEARTBEAT_S:
                    continue
                outputs = EngineCoreOutputs(self.core.engine_index, scheduler_stats=self.core.make_stats())
            elif changed or time.monotonic() - last_sent >= self.HEARTBEAT_S:
                outputs = EngineCoreOutputs(self.core.engine_index, scheduler_stats=self.core.make_stats())
            else:
                continue
            outputs.rejected, self._rejected = self._rejected, []
            self.send(outputs)
            last_sent = time.monotonic()

    def _process_input(self) -> bool:
        import zmq

        changed = False
        while True:
            try:
                kind, payload = self.input_socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed
            changed = True
            kind = EngineCoreRequestType(kind.bytes)
            if kind == EngineCoreRequestType.ADD:
                self.num_adds_seen += 1
                requests = self.add_decoder.decode(payload.buffer)
                try:
                    self.core.add_request(requests)
                except (ValueError, NotImplementedError) as e:  # QueueFullError is a ValueError
                    self._rejected.append(EngineCoreRejection(
                        requests[0].request_id, isinstance(e, QueueFullError), str(e)))
            elif kind == EngineCoreRequestType.ABORT:
                self.core.abort_requests(self.abort_decoder.decode(payload.buffer))
            else:
                self._shutdown = True

    def send(self, outputs: EngineCoreOutputs) -> None:
        outputs.num_adds_seen = self.num_adds_seen
        self.output_socket.send_multipart([MSG_OUTPUTS, self.encoder.encode(outputs)], copy=False)


def _flush_and_close(ctx, output_socket, input_socket, linger_ms: int = 5000) -> None:
    """Closes the sockets and waits (up to linger_ms) until what was sent has left: the
    interpreter's exit does not terminate a zmq context, so a message queued just before it (why
    the core died) could be dropped, and the front end would only see the exit code."""
    input_socket.close(linger=0)
    output_socket.close(linger=linger_ms)
    ctx.term()


def _exit(core: EngineCore, code: int) -> None:
    """Ends the core's process. A program still compiling in the background would be stopped
    inside XLA by the interpreter's exit (an abort), or waited for: leave without either."""
    if core.executor.compiling_in_background():
        multiprocessing.util._exit_function()  # what exit would release (semaphores), but the thread
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (the busy loop's getppid check covers
    the rest)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable")
