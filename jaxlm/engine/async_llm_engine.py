"""AsyncLLMEngine: the asyncio face of LLMEngine for the server.

One dedicated thread owns the LLMEngine front end (which is single-threaded): it drains a queue of
add/abort commands, takes the engine cores' output batches while there is work (step_routed) and
sleeps on a condition when idle. The engine core runs in its own process(es) (EngineCoreProc), so
the scheduler and the device never share this process's GIL; tokenization, detokenization and
the output processor stay here. The event loop never waits on the engine; outputs come back through
one asyncio.Queue per request, handed over with loop.call_soon_threadsafe (one wake-up per loop per
batch, not one per token).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from jaxlm.core.outputs import FinishReason
from jaxlm.engine.async_commands import AbortCommand as _Abort
from jaxlm.engine.async_commands import AddCommand as _Add
from jaxlm.engine.async_commands import Stream as _Stream
from jaxlm.engine.exceptions import EngineDeadError, EngineGenerateError, QueueFullError
from jaxlm.engine.input_processor import ProcessedPrompt, make_internal_request_id
from jaxlm.outputs import RequestOutput
from jaxlm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from jaxlm.engine.arg_utils import EngineArgs
    from jaxlm.engine.llm_engine import LLMEngine

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineGenerateError", "QueueFullError"]

logger = logging.getLogger(__name__)

# Publish engine stats at most this often while busy (always when going idle).
_STATS_INTERVAL_S = 0.05
# Longest wait for the cores' outputs before the commands are looked at again (a new command
# wakes the wait at once); while idle, the cores' health is checked this often.
_POLL_S = 1.0
_ERROR = str(FinishReason.ERROR)


class AsyncLLMEngine:
    """Runs an LLMEngine on its own thread and streams RequestOutputs to asyncio callers."""

    def __init__(self, engine_factory: Callable[[], "LLMEngine"], *, start_timeout: float | None = None) -> None:
        self._cv = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stop = False
        self._abort_on_stop = False
        # Internal id (client id + serial) -> stream; touched only under self._cv. Outputs
        # are routed by internal id, so an aborted request's late outputs reach nobody, even
        # when a new request reuses its client id before the abort is processed.
        self._streams: dict[str, _Stream] = {}
        self._serial = itertools.count()  # internal id suffixes, drawn under self._cv
        self._stats: dict[str, Any] = {}
        self._dead: BaseException | None = None
        self._died = threading.Event()  # set when the loop dies: the server's watchdog exits
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self.engine: "LLMEngine | None" = None
        self.tokenizer: Any = None
        self._thread = threading.Thread(
            target=self._run, args=(engine_factory,), name="jaxlm-engine-loop", daemon=True
        )
        self._thread.start()
        # Building the engine (loading weights, warm-up compiles) happens on the engine thread so
        # that every LLMEngine call comes from that one thread.
        if not self._ready.wait(start_timeout):
            raise TimeoutError("engine did not start in time")
        if self._init_error is not None:
            raise self._init_error

    @classmethod
    def from_engine_args(cls, engine_args: "EngineArgs", core_launcher: Any = None) -> "AsyncLLMEngine":
        from jaxlm.engine.llm_engine import LLMEngine

        # The engine core in its own process(es): data_parallel_size of them (the first one
        # possibly already started by the server, core_launcher).
        return cls(lambda: LLMEngine.from_engine_args(engine_args, multiprocess=True, core_launcher=core_launcher))

    # ---------------------------------------------------------------- properties
    @property
    def engine_config(self) -> Any:
        return self.engine.engine_config

    @property
    def is_running(self) -> bool:
        if self._dead is not None or not self._thread.is_alive() or self._stop:
            return False
        try:
            if self.engine is not None:
                self.engine.check_health()  # a core process that died is seen before the loop sees it
        except EngineDeadError:
            return False
        return True

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"engine loop died: {self._dead!r}")

    def get_stats(self) -> dict[str, Any]:
        """The latest engine stats snapshot (taken on the engine thread)."""
        with self._cv:
            return dict(self._stats)

    def get_num_unfinished_requests(self) -> int:
        with self._cv:
            return len(self._streams)

    def get_input_processor(self) -> Any:
        """The engine's InputProcessor (the one admission path) for checks before queueing."""
        return self.engine.get_input_processor()

    def check_lora(self, lora_request: Any) -> None:
        """ValueError naming what makes an adapter unusable on this model (safe from any thread)."""
        self.engine.lora_checker.check(lora_request)

    def forget_lora(self, lora_int_id: int) -> None:
        """An adapter was unloaded: forget its check (the cores drop it from host memory and its
        slot as newer adapters need the room)."""
        self.engine.lora_checker.forget(lora_int_id)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """SamplingParams defaults from the model's generation_config.json (request fields win)."""
        return self.engine.get_diff_sampling_param()

    # ---------------------------------------------------------------- requests
    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes; closing the generator aborts it.
        Two live requests may share a request_id: each gets its own outputs. lora_request: the
        adapter (a LoRARequest) to run it with."""
        if not self.is_running:
            raise self.dead_error if self._dead is not None else EngineDeadError("engine is stopped")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), request_id, sampling_params.n)
        with self._cv:
            internal_id = make_internal_request_id(request_id, next(self._serial))
            self._streams[internal_id] = stream
            self._commands.append(_Add(request_id, internal_id, prompt, sampling_params,
                                       arrival_time or time.time(), priority, lora_request))
            self._cv.notify()
        self._wakeup()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # cancelled, closed early or the caller raised: free its KV blocks
                self._abort_nowait([internal_id])

    async def beam_search(self, prompt: ProcessedPrompt | list[int], request_id: str, params: BeamSearchParams,
                          priority: int = 0, lora_request: Any = None) -> RequestOutput:
        """vLLM's beam search for one checked prompt (jaxlm/beam_search.py): each step's beams run
        as concurrent requests; one finished RequestOutput, a completion per beam, best first."""
        from jaxlm.beam_search import BeamSearch, run_beam_search_async

        if not isinstance(prompt, ProcessedPrompt):
            prompt = ProcessedPrompt(None, list(prompt))
        mc = self.engine_config.model_config
        search = BeamSearch([prompt.prompt_token_ids], params, self.engine.eos_token_id, mc.max_model_len,
                            mc.max_logprobs)
        # The beams' prompts are the checked prompt plus sampled ids, within max_model_len (BeamSearch).
        return await run_beam_search_async(
            search, lambda ids, sp, rid: self.generate(ProcessedPrompt(None, ids), sp, rid, priority=priority,
                                                  lora_request=lora_request),
            request_id, prompt.prompt, self.tokenizer.decode if self.tokenizer is not None else None)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort every live request with these client ids."""
        client_ids = {request_id} if isinstance(request_id, str) else set(request_id)
        with self._cv:
            internal_ids = [i for i, s in self._streams.items() if s.request_id in client_ids]
        self._abort_nowait(internal_ids)

    def _abort_nowait(self, internal_ids: list[str]) -> None:
        with self._cv:
            for iid in internal_ids:
                self._streams.pop(iid, None)
            self._commands.append(_Abort(internal_ids))
            self._cv.notify()
        self._wakeup()

    def _wakeup(self) -> None:
        """The engine thread may be waiting on the cores' outputs: a command is waiting."""
        if self.engine is not None:
            self.engine.wakeup()

    def check_queue_room(self, num_seqs: int) -> None:
        """QueueFullError, before anything is queued, when num_seqs more sequences (n × prompts
        of one request) would overflow the waiting queues (of all data-parallel cores). Counts the
        sequences of the open requests (exact here, while the cores' stats lag); each core checks
        its own adds as well."""
        sched = self.engine_config.scheduler_config
        limit = getattr(sched, "max_num_queued_reqs", None)
        if limit is None:
            return
        parallel = getattr(self.engine_config, "parallel_config", None)
        num_engines = getattr(parallel, "data_parallel_size", 1)
        with self._cv:
            busy = sum(s.num_seqs for s in self._streams.values())
        if busy + num_seqs - sched.max_num_seqs * num_engines > limit * num_engines:
            raise QueueFullError(f"The waiting queue is full ({limit} requests; this request needs "
                                 f"{num_seqs}); try again later")

    def wait_until_dead(self, timeout: float | None = None) -> bool:
        """Blocks until the engine loop has died (not a clean stop); True if it has."""
        return self._died.wait(timeout)

    async def check_health(self) -> None:
        if not self.is_running:
            raise self.dead_error

    def shutdown(self, abort_requests: bool = True, timeout: float | None = 30.0) -> None:
        """Stops the loop; in-flight requests are aborted (or finished if abort_requests=False)."""
        with self._cv:
            self._stop = True
            self._abort_on_stop = abort_requests
            self._cv.notify()
        self._wakeup()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---------------------------------------------------------------- engine thread
    def _run(self, engine_factory: Callable[[], "LLMEngine"]) -> None:
        try:
            engine = engine_factory()
            self.engine = engine
            self.tokenizer = _frontend_tokenizer(engine.tokenizer)
            self._publish_stats(engine)
        except BaseException as e:  # noqa: BLE001 - reported to the constructor's caller
            self._init_error = e
            self._dead = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(engine)
        except BaseException as e:  # noqa: BLE001 - every pending request gets the error
            logger.exception("engine loop died")
            self._dead = e
            self._fail_all(self.dead_error)
            self._died.set()  # the watchdog starts its exit timer now, not after the cleanup
            self._shutdown_engine(engine)
        else:
            self._fail_all(EngineDeadError("engine is stopped"))
            self._shutdown_engine(engine)

    @staticmethod
    def _shutdown_engine(engine: "LLMEngine") -> None:
        try:
            engine.shutdown()  # the engine-core processes: SHUTDOWN, then killed if they linger
        except Exception:  # noqa: BLE001
            logger.exception("stopping the engine cores failed")

    def _loop(self, engine: "LLMEngine") -> None:
        last_stats = 0.0
        # Core processes keep reporting while idle (a heartbeat with fresh stats, and at once
        # after the abort that ends the last request): an idle front end reads them, so the
        # gauges drop to zero without a new request.
        remote = getattr(engine, "has_core_process", False)
        while True:
            with self._cv:
                while not remote and self._idle_locked(engine):
                    self._publish_stats_locked(engine)  # idle: the gauges must read zero now
                    if not self._cv.wait(_POLL_S):
                        engine.check_health()  # a core that dies while idle kills the engine too
                idle = self._idle_locked(engine)
                if idle:
                    self._publish_stats_locked(engine)
                commands, self._commands = self._commands, []
                stop, abort_on_stop = self._stop, self._abort_on_stop
            if idle:  # a new command wakes this wait (engine.wakeup)
                self._dispatch(engine, engine.step_routed(timeout=_POLL_S))  # late outputs reach nobody
                continue
            for cmd in commands:
                if isinstance(cmd, _Abort):
                    engine.abort_request(cmd.internal_ids, internal=True)
                else:
                    self._add(engine, cmd)
            if stop and (abort_on_stop or not engine.has_unfinished_requests()):
                with self._cv:
                    pending = list(self._streams)
                if pending:
                    engine.abort_request(pending, internal=True)
                return
            if engine.has_unfinished_requests():
                outputs = engine.step_routed(timeout=_POLL_S)
                if outputs:
                    self._dispatch(engine, outputs)
                now = time.monotonic()
                if now - last_stats >= _STATS_INTERVAL_S:
                    self._publish_stats(engine)
                    last_stats = now

    def _idle_locked(self, engine: "LLMEngine") -> bool:
        return not self._commands and not self._stop and not engine.has_unfinished_requests()

    def _add(self, engine: "LLMEngine", cmd: _Add) -> None:
        with self._cv:
            if cmd.internal_id not in self._streams:
                return  # aborted before it reached the engine
        try:
            # Raises ValueError for bad input, QueueFullError past --max-num-queued-reqs.
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                               internal_request_id=cmd.internal_id, priority=cmd.priority,
                               lora_request=cmd.lora_request)
        except Exception as e:  # noqa: BLE001 - goes to this request's caller only
            with self._cv:
                stream = self._streams.pop(cmd.internal_id, None)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)

    def _dispatch(self, engine: "LLMEngine", outputs: list[tuple[str, RequestOutput]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        failed: list[str] = []
        with self._cv:
            for internal_id, out in outputs:
                item: RequestOutput | BaseException = out
                if any(o.finish_reason == _ERROR for o in out.outputs):  # failed alone: its caller gets the error
                    why = engine.pop_request_error(internal_id) or "unknown error"
                    item = why if isinstance(why, Exception) else EngineGenerateError(
                        f"request {out.request_id!r} failed in the engine: {why}")
                    out.finished = True
                    failed.append(internal_id)
                stream = self._streams.get(internal_id)
                if stream is None:
                    continue  # aborted meanwhile
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
            for internal_id, out in outputs:  # after the loop: n > 1 gives several outputs a step
                if out.finished:
                    self._streams.pop(internal_id, None)
        if failed:  # n > 1: the failed request's other sequences stop too
            engine.abort_request(failed, internal=True)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed; nobody is listening
                pass

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass

    def _publish_stats(self, engine: "LLMEngine") -> None:
        with self._cv:
            self._publish_stats_locked(engine)

    def _publish_stats_locked(self, engine: "LLMEngine") -> None:
        try:
            self._stats = dict(engine.get_stats())
        except Exception:  # noqa: BLE001 - stats must never kill the loop
            logger.exception("get_stats failed")


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _frontend_tokenizer(tokenizer: Any) -> Any:
    """A private copy for the event-loop thread: HF fast tokenizers can fail with 'Already
    borrowed' when one instance encodes on two threads at once."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001
        logger.warning("could not copy the tokenizer; sharing the engine's")
        return tokenizer
