"""UniProcExecutor: one worker on one device, in this process."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.executor.abstract import Executor
from jaxlm.executor.compilation_cache import configure_compilation_cache
from jaxlm.worker.worker import Worker


class UniProcExecutor(Executor):
    """One worker in this process; its mesh is one device here (MeshExecutor: several)."""

    def _init_executor(self) -> None:
        configure_compilation_cache(self.config.compilation_config)  # engine start: once, before compiling
        self.mesh = self._make_mesh()
        self.worker = Worker(self.config, self.mesh)
        self.worker.load_model()

    def _make_mesh(self) -> jax.sharding.Mesh:
        # Auto axes: GSPMD propagates shardings (explicit axes would demand them on every gather).
        return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))

    def determine_num_available_blocks(self) -> int:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)
        self.worker.compile_or_warm_up_model()

    def load_deferred_program(self) -> bool:
        return self.worker.model_runner.load_deferred_program()

    def compiling_in_background(self) -> bool:
        background = self.worker.model_runner.background
        return background is not None and background.running()

    def shutdown(self) -> None:
        self.worker.release()

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        return self.worker.execute_model(scheduler_output, non_block)
