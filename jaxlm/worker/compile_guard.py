"""CompileGuard: counts the XLA compiles that happen while a step runs.

Every program is compiled ahead of time at warm-up, so a compile during a step means a shape
escaped the buckets (tests assert the count stays 0). The runner enters `step()` around each
step; a JAX monitoring listener counts backend compiles seen inside, on the step's own thread
(a background compile, worker/background_compile.py, runs beside the steps). The listener holds
the guard weakly and unregisters itself once the guard is gone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any, Iterator

import jax

logger = logging.getLogger(__name__)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileGuard:
    def __init__(self) -> None:
        self.in_step = False
        self.step_thread: int | None = None
        self.count = 0  # compiles seen inside a step (must stay 0 after warm-up)
        ref = weakref.ref(self)

        def on_event(name: str, duration: float, **_: Any) -> None:
            guard = ref()
            if guard is None:
                jax.monitoring.unregister_event_duration_listener(on_event)
            elif name == _COMPILE_EVENT and guard.in_step and threading.get_ident() == guard.step_thread:
                guard.count += 1
                logger.warning("XLA compiled a program while serving (%.2f s): a shape escaped the buckets",
                               duration)

        jax.monitoring.register_event_duration_secs_listener(on_event)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.in_step, self.step_thread = True, threading.get_ident()
        try:
            yield
        finally:
            self.in_step = False
        self.step_thread: int | None = None
