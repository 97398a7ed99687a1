"""MultiHostExecutor: rank 0 of several nodes, and the followers' worker loop (``--headless``).

Every node runs the same SPMD program over one global mesh (``jax.distributed``): rank 0
schedules, sends each step's SchedulerOutput to the followers (multihost_channel), and runs the
step itself; each follower builds the same inputs from it (its InputBatch sees the same updates
and the same replicated sampled tokens) and runs the same step. Rank 0 also sends its resolved
EngineConfig (buckets included) and the KV-cache size it chose, so every node compiles the
same programs in the same order and allocates the same cache.

Faults: rank 0 runs each step on a step thread and waits for it under a watchdog. A follower
that is killed (its connection closes; gloo collectives fail at once) or hangs (no heartbeat,
or a step past ``distributed_timeout_seconds``) makes ``execute_model`` raise NodeLostError,
so the engine dies the usual way (EngineDeadError to open requests, the server exits 1). A
follower exits 1 as soon as rank 0 is gone or silent; JAX's own heartbeat is the backstop.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

from jaxlm.config import EngineConfig, ParallelConfig, arg_fields
from jaxlm.core.outputs import ModelRunnerOutput
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.executor.distributed import check_world_size, init_distributed
from jaxlm.executor.mesh_executor import MeshExecutor
from jaxlm.executor.multihost_channel import STARTUP_TIMEOUT_S, StepBroadcaster, StepReceiver
from jaxlm.model_loader import get_tokenizer
from jaxlm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# A lost node that no step noticed by then (rank 0 idle) ends rank 0's process.
_IDLE_EXIT_S = 2.0
_CONFIG, _INIT_CACHE, _GRAMMAR, _STEP, _SHUTDOWN = "config", "init_cache", "grammar", "step", "shutdown"


class NodeLostError(RuntimeError):
    """A node of the mesh died or hangs: the engine cannot run another step."""


def _wait_for(lost: Callable[[], str | None], seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while (why := lost()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return why


class _StepThread:
    """Runs steps off the caller's thread, so a collective that never returns cannot hang it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="jaxlm-multihost-step", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                box.append((False, e))
            done.set()

    def run(self, fn: Callable[[], Any], timeout_s: float, lost: Callable[[], str | None]) -> Any:
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        deadline = time.monotonic() + timeout_s
        while not done.wait(0.05):
            if (why := lost()) is not None:
                raise NodeLostError(why)
            if time.monotonic() > deadline:
                raise NodeLostError(
                    f"a step ran past {timeout_s} s: a collective never returned (a node hangs?)")
        ok, value = box[0]
        if ok:
            return value
        # A failed collective most likely means a lost node: give the heartbeats a moment to say which.
        why = _wait_for(lost, 1.0)
        raise NodeLostError(f"{why or 'the step failed'}: {type(value).__name__}: {value}") from value


class MultiHostExecutor(MeshExecutor):
    """Rank 0: the global mesh's driver; the other nodes follow its steps."""

    def _init_executor(self) -> None:
        parallel = self.config.parallel_config
        init_distributed(parallel)
        check_world_size(parallel)
        self._timeout = parallel.distributed_timeout_seconds
        self.channel = StepBroadcaster(parallel.master_port, parallel.nnodes - 1, self._timeout,
                                       on_lost=functools.partial(_exit_if_unnoticed, weakref.ref(self)))
        # Followers leave cleanly when rank 0's engine goes away (gc or interpreter exit).
        self._shutdown = weakref.finalize(self, self.channel.close, (_SHUTDOWN,))
        self.channel.wait_for_followers(STARTUP_TIMEOUT_S)
        self.channel.send((_CONFIG, self.config))
        self._steps = _StepThread()
        self._failed: str | None = None
        self._grammar_sent = False
        super()._init_executor()  # the global mesh; each node places only its own shards

    def initialize_cache(self, num_blocks: int) -> None:
        # Rank 0 sized it; every node allocates the same and compiles the same programs.
        self.channel.send((_INIT_CACHE, num_blocks))
        super().initialize_cache(num_blocks)
        # Lock-step: the first step's collectives must not wait on a node still compiling.
        self.channel.wait_for_followers(STARTUP_TIMEOUT_S, "warmed up")

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> ModelRunnerOutput:
        if non_block:
            raise NotImplementedError("several nodes run each step to its end (no async scheduling)")
        self.check_health()
        manager = self.worker.model_runner.grammars.manager
        if manager is not None and not self._grammar_sent:
            # The engine built it for the first constrained request: followers build its twin,
            # so every node fills the same bitmask (an input of the replicated sampler).
            self.channel.send((_GRAMMAR, manager.eos_token_ids))
            self._grammar_sent = True
        self.channel.send((_STEP, scheduler_output))
        try:
            return self._steps.run(lambda: self.worker.execute_model(scheduler_output), self._timeout,
                                   lambda: self.channel.lost)
        except NodeLostError as e:
            self._failed = str(e)
            raise

    def check_health(self) -> None:
        """Raises NodeLostError once a node is lost (vLLM's Executor.check_health)."""
        self._failed = self._failed or self.channel.lost
        if self._failed is not None:
            raise NodeLostError(self._failed)

    def shutdown(self) -> None:
        self._shutdown()
        super().shutdown()


def _exit_if_unnoticed(executor_ref: weakref.ref, why: str) -> None:
    """A node was lost while rank 0 was idle: no step will raise for the engine to die of, and
    JAX's own heartbeat would abort this process much later. Exit now, as a follower does."""

    def check() -> None:
        executor = executor_ref()
        if executor is not None and executor._failed is None:
            logger.error("multihost: %s while no step ran; exiting (code 1)", why)
            logging.shutdown()
            os._exit(1)

    timer = threading.Timer(_IDLE_EXIT_S, check)
    timer.daemon = True
    timer.start()


def _lost_rank0(why: str) -> None:
    logger.error("multihost follower: %s; exiting", why)
    logging.shutdown()
    os._exit(1)  # the main thread may sit in a collective that never returns


def run_follower(parallel: ParallelConfig) -> int:
    """A follower node's worker loop (node_rank > 0): 0 when rank 0 shut down cleanly."""
    if parallel.nnodes < 2 or parallel.node_rank == 0:
        raise ValueError(f"a follower needs nnodes > 1 and node_rank > 0 "
                         f"(got nnodes={parallel.nnodes}, node_rank={parallel.node_rank})")
    init_distributed(parallel)
    channel = StepReceiver(parallel.master_addr, parallel.master_port, parallel.node_rank,
                           parallel.distributed_timeout_seconds, on_lost=_lost_rank0)
    kind, config = channel.recv()
    if kind != _CONFIG:
        raise RuntimeError(f"expected rank 0's engine config first, got {kind!r}")
    logger.info("multihost follower %d: serving %s for rank 0", parallel.node_rank, config.model_config.model)
    executor = MeshExecutor(config)  # rank 0's config: the same mesh, weights and buckets
    while True:
        message = channel.recv()
        if message[0] == _STEP:
            try:
                executor.execute_model(message[1])  # rank 0 reads the (replicated) tokens
            except Exception:
                # A failed collective most likely means rank 0 is gone: let the heartbeats say so.
                _wait_for(lambda: channel.lost, 1.0)
                raise
        elif message[0] == _GRAMMAR:
            executor.get_model_runner().grammars.manager = _structured_output_manager(config, message[1])
        elif message[0] == _INIT_CACHE:
            executor.initialize_cache(message[1])
            channel.report()  # warmed up
        elif message[0] == _SHUTDOWN:
            logger.info("multihost follower %d: rank 0 shut down", parallel.node_rank)
            channel.close()
            return 0


def _structured_output_manager(config: EngineConfig, eos_token_ids: list[int] | None
                               ) -> StructuredOutputManager:
    mc = config.model_config
    return StructuredOutputManager(get_tokenizer(mc), int(mc.hf_config.vocab_size), eos_token_ids=eos_token_ids)


def run_headless(args: argparse.Namespace) -> int:
    """``python -m jaxlm.serve --headless --nnodes N --node-rank I --master-addr A --master-port P``."""
    parallel = ParallelConfig(**{f.name: getattr(args, f.name) for f in arg_fields(ParallelConfig)})
    try:
        return run_follower(parallel)
    except Exception:  # noqa: BLE001 - a follower has nobody to report to but its log
        logger.exception("multihost follower %d failed", parallel.node_rank)
        logging.shutdown()
        os._exit(1)  # jax.distributed's exit barrier would wait for the dead peers
