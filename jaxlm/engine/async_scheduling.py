"""AsyncStepDriver: schedule and dispatch step N+1 while the device runs step N (--async-scheduling).

Per call: schedule step N+1 (AsyncScheduler: placeholders for the tokens in flight), dispatch
it (executor.execute_model(non_block=True): its decode rows read step N's tokens on the
device), then wait for step N's tokens and hand (N's scheduler output, N's runner output) to
`update` (the engine's Scheduler.update_from_output and output processing). The host's
schedule/prepare of N+1 thus runs while the device computes N, and N's update and
detokenization run while it computes N+1.

Fallback per step: while the scheduler holds a request that needs the host in the loop
(AsyncScheduler.needs_sync_step: structured outputs, penalties, min_tokens, bad words), the
step in flight is finished before the next is scheduled, and that step is finished before
the call returns: the synchronous loop.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxlm.core.async_scheduler import AsyncScheduler
from jaxlm.core.sched_output import SchedulerOutput


class AsyncStepDriver:
    def __init__(self, scheduler: AsyncScheduler, executor: Any) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self._in_flight: tuple[SchedulerOutput, Any] | None = None

    def has_in_flight(self) -> bool:
        return self._in_flight is not None

    def _finish(self, update: Callable[[SchedulerOutput, Any], Any]) -> list:
        so, handle = self._in_flight
        self._in_flight = None
        return [update(so, handle.result())]

    def step(self, update: Callable[[SchedulerOutput, Any], Any]) -> list:
        """One engine step; returns what `update` returned for each step that completed, in order."""
        outputs: list = []
        if self._in_flight is not None and self.scheduler.needs_sync_step():
            outputs += self._finish(update)
        so = self.scheduler.schedule()
        handle = self.executor.execute_model(so, non_block=True)
        if self._in_flight is not None:
            outputs += self._finish(update)
        self._in_flight = (so, handle)
        if self.scheduler.needs_sync_step() or not self.scheduler.has_unfinished_requests():
            outputs += self._finish(update)
        return outputs
