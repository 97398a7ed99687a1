"""EngineCoreClient: how the front end reaches its engine core(s) (vLLM's names).

InprocClient calls an EngineCore in this process (LLM: no extra process). SyncMPClient drives one
EngineCoreProc child over ZMQ (msgpack, in batches); DPLBSyncMPClient drives data_parallel_size
of them and sends each new request to the least loaded one. The multiprocess clients are driven
from the front end's engine thread (AsyncLLMEngine), never from the event loop.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

from jaxlm.config import EngineConfig
from jaxlm.core.stats import SchedulerStats
from jaxlm.engine.core import EngineCore, EngineCoreProc
from jaxlm.engine.exceptions import EngineDeadError
from jaxlm.engine.messages import (
    MSG_FAILED, MSG_OUTPUTS, MSG_READY, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest,
    EngineCoreRequestType, MsgpackDecoder, MsgpackEncoder)

if TYPE_CHECKING:
    from jaxlm.engine.core_launcher import CoreLauncher

logger = logging.getLogger(__name__)

# A core that sends nothing (not even its idle heartbeat) for this long is taken for dead.
CORE_SILENCE_TIMEOUT_S = 60.0
# How long a core gets to exit after SHUTDOWN before it is killed.
_SHUTDOWN_TIMEOUT_S = 5.0


class EngineCoreClient(abc.ABC):
    """The front end's side of the core: adds, aborts, a batch of outputs per call."""

    num_engines: int = 1

    @staticmethod
    def make_client(config: EngineConfig, multiprocess: bool, core_env: dict[str, str | None] | None = None,
                    core_launcher: "CoreLauncher | None" = None) -> "EngineCoreClient":
        """core_env: environment changes for the core processes (see prepare_frontend_process);
        core_launcher: a single core's process, already started (the server's)."""
        if core_launcher is not None and (not multiprocess or config.parallel_config.data_parallel_size > 1):
            core_launcher.cancel()  # the core runs here, or several run: the early one is not it
            core_launcher = None
        if not multiprocess:
            if config.parallel_config.data_parallel_size > 1:
                raise ValueError("data_parallel_size > 1 runs one engine-core process per replica: "
                                 "use the server (python -m jaxlm.serve), not the in-process LLM")
            return InprocClient(config)
        if config.parallel_config.data_parallel_size > 1:
            return DPLBSyncMPClient(config, core_env)
        return SyncMPClient(config, core_env, core_launcher)

    @abc.abstractmethod
    def add_request(self, requests: list[EngineCoreRequest]) -> int:
        """One user request's sequences (first child first); returns the index of the engine
        core that takes them."""

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self, timeout: float | None = None) -> list[EngineCoreOutputs]:
        """The next batches of outputs ([] when none came within timeout seconds)."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool:
        """The core(s) still hold work the front end has not seen finish."""

    @abc.abstractmethod
    def get_scheduler_stats(self) -> list[SchedulerStats]:
        """The latest stats of each core, by engine index."""

    def check_health(self) -> None:
        """EngineDeadError when a core is gone."""

    def wakeup(self) -> None:
        """Cut a get_output wait short (called from other threads)."""

    def shutdown(self) -> None: ...


def prepare_frontend_process() -> dict[str, str | None]:
    """Before a front end whose cores run in other processes touches jax: it runs no device work,
    so it must not preallocate accelerator memory (XLA takes 75% of each GPU at start-up) that its
    cores need. Returns the environment changes that undo this in the cores."""
    key = "XLA_PYTHON_CLIENT_PREALLOCATE"
    if key in os.environ:
        return {}
    os.environ[key] = "false"
    return {key: None}


class InprocClient(EngineCoreClient):
    """The EngineCore in this process: get_output runs one step."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        self._stats = self.engine_core.make_stats()
        self._closed = False

    def add_request(self, requests: list[EngineCoreRequest]) -> int:
        if self._closed:
            raise EngineDeadError("the engine was shut down (shutdown()): build a new one")
        self.engine_core.add_request(requests)  # raises at once: nothing is queued
        return self.engine_core.engine_index

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> list[EngineCoreOutputs]:
        outputs = self.engine_core.step()
        self._stats = outputs.scheduler_stats
        return [outputs]

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_scheduler_stats(self) -> list[SchedulerStats]:
        return [self.engine_core.make_stats()]

    def shutdown(self) -> None:
        """Frees the engine's device memory now, whoever still refers to the engine."""
        if not self._closed:
            self._closed = True
            self.engine_core.abort_requests(
                [r.request_id for r in list(self.engine_core.scheduler.requests.values())])
            self.engine_core.shutdown()


@dataclasses.dataclass
class _CoreHandle:
    index: int
    process: Any  # multiprocessing.Process
    input_socket: Any  # zmq PUSH
    stats: SchedulerStats = dataclasses.field(default_factory=SchedulerStats)
    num_adds_sent: int = 0
    num_adds_seen: int = 0
    last_heard: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def load(self) -> int:
        """Queued + running, as the core last reported them, plus the adds still in flight."""
        return self.stats.num_waiting_reqs + self.stats.num_running_reqs + self.num_adds_sent - self.num_adds_seen


class SyncMPClient(EngineCoreClient):
    """data_parallel_size engine-core processes (one unless DP), started and warmed up before
    the constructor returns; the parent owns their lifecycle (SHUTDOWN, then kill)."""

    def __init__(self, config: EngineConfig, core_env: dict[str, str | None] | None = None,
                 core_launcher: "CoreLauncher | None" = None) -> None:
        import zmq

        self.num_engines = config.parallel_config.data_parallel_size
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="jaxlm-core-")
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        output_addr = f"ipc://{self._dir}/out"
        self._output_socket = self._ctx.socket(zmq.PULL)
        self._output_socket.bind(output_addr)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.cores: list[_CoreHandle] = []
        # Core request id -> the engine holding it (aborts go there only).
        self._owner: dict[str, int] = {}
        self._dead: str | None = None
        spawn = multiprocessing.get_context("spawn")
        devices_per_core = config.parallel_config.tensor_parallel_size * config.parallel_config.pipeline_parallel_size
        try:
            for i in range(self.num_engines):
                input_socket = self._ctx.socket(zmq.PUSH)
                input_addr = f"ipc://{self._dir}/in{i}"
                input_socket.bind(input_addr)
                env = dict(core_env or {})
                if self.num_engines > 1:  # data parallel: this core's share of the accelerators
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(
                        str(d) for d in range(i * devices_per_core, (i + 1) * devices_per_core))
                run_args = (config, i, input_addr, output_addr, os.getpid(), env)
                if core_launcher is not None:  # started before the front end: its imports are done
                    process = core_launcher.launch(*run_args)
                else:
                    process = spawn.Process(target=EngineCoreProc.run_engine_core, name=f"EngineCore_{i}",
                                            args=run_args, daemon=True)
                    process.start()
                self.cores.append(_CoreHandle(i, process, input_socket))
            self._poller = zmq.Poller()
            self._poller.register(self._output_socket, zmq.POLLIN)
            self._poller.register(self._wake_r, zmq.POLLIN)
            for core in self.cores:
                self._poller.register(core.process.sentinel, zmq.POLLIN)
            self._wait_for_ready(config)
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_ready(self, config: EngineConfig) -> None:
        decoder = MsgpackDecoder(EngineCoreReady)
        waiting = {core.index for core in self.cores}
        num_blocks = []
        while waiting:
            if not self._output_socket.poll(500):
                self._raise_if_dead(starting=True)
                continue
            kind, payload = self._output_socket.recv_multipart()
            if kind == MSG_FAILED:
                index, exc_type, message = MsgpackDecoder(tuple[int, str, str]).decode(payload)
                error = ValueError if exc_type == "ValueError" else RuntimeError
                raise error(f"engine core {index} failed to start: {exc_type}: {message}")
            if kind == MSG_READY:
                ready = decoder.decode(payload)
                waiting.discard(ready.engine_index)
                self.cores[ready.engine_index].last_heard = time.monotonic()
                num_blocks.append(ready.num_gpu_blocks)
                config.model_config.weight_bytes = ready.model_weight_bytes or None
        config.cache_config.num_gpu_blocks = min(num_blocks)
        logger.info("%d engine core process(es) ready (pids %s)", len(self.cores),
                    ", ".join(str(c.process.pid) for c in self.cores))

    # ---------------------------------------------------------------- requests
    def _pick_core(self) -> _CoreHandle:
        return self.cores[0]

    def add_request(self, requests: list[EngineCoreRequest]) -> int:
        core = self._pick_core()
        for r in requests:
            self._owner[r.request_id] = core.index
        core.num_adds_sent += 1
        self._send(core, EngineCoreRequestType.ADD, requests)
        return core.index

    def abort_requests(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            index = self._owner.pop(rid, None)
            if index is not None:
                by_core.setdefault(index, []).append(rid)
        for index, ids in by_core.items():
            self._send(self.cores[index], EngineCoreRequestType.ABORT, ids)

    def _send(self, core: _CoreHandle, kind: EngineCoreRequestType, payload: Any) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        core.input_socket.send_multipart([kind.value, self._encoder.encode(payload)], copy=False)

    # ---------------------------------------------------------------- outputs
    def get_output(self, timeout: float | None = None) -> list[EngineCoreOutputs]:
        zmq = self._zmq
        events = dict(self._poller.poll(None if timeout is None else int(timeout * 1000)))
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        batches = []
        while True:
            try:
                kind, payload = self._output_socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if kind.bytes != MSG_OUTPUTS:
                continue
            batch = self._decoder.decode(payload.buffer)
            core = self.cores[batch.engine_index]
            core.last_heard = time.monotonic()
            if batch.engine_dead is not None:
                self._dead = f"engine core {batch.engine_index} died: {batch.engine_dead}"
                raise EngineDeadError(self._dead)
            core.num_adds_seen = batch.num_adds_seen
            if batch.scheduler_stats is not None:
                core.stats = batch.scheduler_stats
            for req_id in batch.outputs.finished_req_ids():
                self._owner.pop(req_id, None)
            for rejection in batch.rejected:
                self._owner.pop(rejection.request_id, None)
            batches.append(batch)
        try:
            self.check_health()
        except EngineDeadError as e:
            if self._dead is None:  # an exit seen, its cause maybe still on the way
                self._await_last_words()
                self._dead = self._dead or str(e)
            raise EngineDeadError(self._dead) from None
        self._check_silence()
        return batches

    def _await_last_words(self, timeout_s: float = 1.0) -> None:
        """A core that died of an error sends why just before it exits; the exit may be seen
        first. Its message, if it comes within `timeout_s`, names the cause instead of the exit
        code (the engine is dead: other outputs still arriving are dropped)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self._output_socket.poll(int(left * 1000)):
            kind, payload = self._output_socket.recv_multipart(copy=False)
            if kind.bytes == MSG_OUTPUTS:
                batch = self._decoder.decode(payload.buffer)
                if batch.engine_dead is not None:
                    self._dead = f"engine core {batch.engine_index} died: {batch.engine_dead}"
                    return

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def get_scheduler_stats(self) -> list[SchedulerStats]:
        return [core.stats for core in self.cores]

    def wakeup(self) -> None:
        if self._ctx.closed:
            return  # the pipe is closed (its fd number may belong to another file by now)
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the client is shut down)

    # ---------------------------------------------------------------- lifecycle
    def check_health(self) -> None:
        """EngineDeadError when a core process exited. Safe from any thread (reads the process
        sentinels; reaps nothing)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._raise_if_dead()

    def _check_silence(self) -> None:
        """A core that sent nothing, not even its idle heartbeat, for too long is dead."""
        now = time.monotonic()
        for core in self.cores:
            if now - core.last_heard > CORE_SILENCE_TIMEOUT_S:
                self._dead = (f"engine core {core.index} (pid {core.process.pid}) sent nothing for "
                              f"{now - core.last_heard:.0f} s")
                raise EngineDeadError(self._dead)

    def _raise_if_dead(self, starting: bool = False) -> None:
        gone = multiprocessing.connection.wait([c.process.sentinel for c in self.cores], timeout=0)
        for core in self.cores:
            if core.process.sentinel in gone:
                core.process.join(0.1)
                why = f"engine core {core.index} (pid {core.process.pid}) exited with code {core.process.exitcode}"
                if starting:
                    raise RuntimeError(f"{why} while starting")
                # Not kept in _dead here (any thread may ask): get_output keeps it, or the cause the
                # core sent just before it exited.
                raise EngineDeadError(why)

    def shutdown(self) -> None:
        """SHUTDOWN to every live core, then kill what is left after a grace period."""
        if self._ctx.closed:
            return
        for core in self.cores:
            if core.process.is_alive():
                try:
                    core.input_socket.send_multipart([EngineCoreRequestType.SHUTDOWN.value, b""],
                                                     flags=self._zmq.NOBLOCK)
                except self._zmq.ZMQError:
                    pass
        deadline = time.monotonic() + _SHUTDOWN_TIMEOUT_S
        for core in self.cores:
            core.process.join(max(0.0, deadline - time.monotonic()))
            if core.process.is_alive():
                logger.warning("engine core %d did not stop: killing it", core.index)
                core.process.kill()
                core.process.join(5)
        for core in self.cores:
            core.input_socket.close(linger=0)
        self._output_socket.close(linger=0)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)


class DPLBSyncMPClient(SyncMPClient):
    """Data parallel: each new request goes to the least loaded core (queued + running from
    the counts each core reports, plus what was sent to it since); outputs of all are merged."""

    def _pick_core(self) -> _CoreHandle:
        return min(self.cores, key=lambda c: (c.load, c.index))
