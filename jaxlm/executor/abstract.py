"""Executor: where steps run. The engine talks to this interface only."""

from __future__ import annotations

import abc

from jaxlm.config import EngineConfig
from jaxlm.core.outputs import ModelRunnerOutput
from jaxlm.core.sched_output import SchedulerOutput


class Executor(abc.ABC):
    def __init__(self, config: EngineConfig):
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        parallel = config.parallel_config
        if parallel.tensor_parallel_size * parallel.data_parallel_size == 1:
            from jaxlm.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        raise NotImplementedError(
            "tensor_parallel_size/data_parallel_size > 1 need the mesh executor, which is not built yet"
        )

    @abc.abstractmethod
    def _init_executor(self) -> None: ...

    @abc.abstractmethod
    def determine_num_available_blocks(self) -> int: ...

    @abc.abstractmethod
    def initialize_cache(self, num_blocks: int) -> None: ...

    def get_model_runner(self):
        """The runner of this process's worker (in-process executors only)."""
        return self.worker.model_runner

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
