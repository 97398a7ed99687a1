"""Executor: where steps run. The engine talks to this interface only."""

from __future__ import annotations

import abc
import importlib
from typing import Any

from jaxlm.config import EngineConfig
from jaxlm.core.sched_output import SchedulerOutput

# Executors by qualified name (resolved on use, as vLLM's distributed_executor_backend): the
# interface never imports its implementations, so there is no import cycle.
_UNIPROC_EXECUTOR = "jaxlm.executor.uniproc_executor:UniProcExecutor"
_MESH_EXECUTOR = "jaxlm.executor.mesh_executor:MeshExecutor"
_MULTIHOST_EXECUTOR = "jaxlm.executor.multihost_executor:MultiHostExecutor"


class Executor(abc.ABC):
    def __init__(self, config: EngineConfig):
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        parallel = config.parallel_config
        if parallel.nnodes > 1 and parallel.node_rank > 0:
            raise ValueError(
                f"node_rank={parallel.node_rank}: only rank 0 runs the engine; start the other nodes "
                "with `python -m jaxlm.serve --headless --nnodes N --node-rank I ...`")
        if parallel.nnodes > 1 and parallel.pipeline_parallel_size > 1:
            # MPMD stages on other hosts would need cross-process device_put of the hidden state.
            raise NotImplementedError(
                f"pipeline_parallel_size={parallel.pipeline_parallel_size} with nnodes={parallel.nnodes}: "
                "pipeline stages across several nodes are not supported yet; use tensor parallel "
                "across nodes, or pipeline parallel within one node")
        if parallel.nnodes > 1:
            qualified = _MULTIHOST_EXECUTOR
        else:
            several = parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1
            qualified = _MESH_EXECUTOR if several else _UNIPROC_EXECUTOR
        module, name = qualified.split(":")
        return getattr(importlib.import_module(module), name)

    @abc.abstractmethod
    def _init_executor(self) -> None: ...

    @abc.abstractmethod
    def determine_num_available_blocks(self) -> int: ...

    @abc.abstractmethod
    def initialize_cache(self, num_blocks: int) -> None: ...

    def get_model_runner(self) -> Any:
        """The runner of this process's worker (in-process executors only)."""
        return self.worker.model_runner

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        """Run one step: its ModelRunnerOutput, or with non_block a handle whose result()
        returns it (vLLM's Future), so the caller can dispatch the next step first."""

    def load_deferred_program(self) -> bool:
        """Loads one compiled program a warm start deferred (called while the engine idles);
        False when none is left. Only in-process runners defer."""
        return False

    def compiling_in_background(self) -> bool:
        """Whether a thread is still compiling programs (compile_in_background); in-process runners only."""
        return False

    def check_health(self) -> None:
        """Raises when the executor cannot run another step (a lost node); in-process: never."""

    def shutdown(self) -> None:
        """Releases what the executor holds: its device buffers, and the other nodes."""
