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


class Executor(abc.ABC):
    def __init__(self, config: EngineConfig):
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        parallel = config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError(
                f"pipeline_parallel_size={parallel.pipeline_parallel_size}: pipeline parallelism is not "
                "supported yet; the mesh executor runs tensor parallel only")
        if parallel.data_parallel_size > 1:
            raise NotImplementedError(
                f"data_parallel_size={parallel.data_parallel_size}: data-parallel replicas are engine-core "
                "processes (a separate issue); the mesh executor runs tensor parallel only")
        qualified = _MESH_EXECUTOR if parallel.tensor_parallel_size > 1 else _UNIPROC_EXECUTOR
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
