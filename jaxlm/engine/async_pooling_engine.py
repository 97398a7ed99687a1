"""AsyncPoolingEngine: the server's pooling engine — one thread runs the PoolingEngine's
steps; asyncio callers await whole calls (every input of one request), so concurrent requests
share steps (continuous batching of prefill-only work). Tokenization and validation run on the
caller's worker thread, the steps on the engine thread, the event loop on neither."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Sequence

from jaxlm.engine.exceptions import EngineDeadError
from jaxlm.engine.pooling_engine import PoolingEngine, PoolingPrompt
from jaxlm.outputs_pooling import PoolingRequestOutput
from jaxlm.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


class _Call:
    """One caller's requests and the future their outputs resolve."""

    def __init__(self, reqs: list[Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.ids = [r.request_id for r in reqs]
        self.reqs = reqs
        self.loop, self.future = loop, future
        self.outputs: dict[str, PoolingRequestOutput] = {}

    def resolve(self, value: Any, error: bool = False) -> None:
        def set_it() -> None:
            if not self.future.done():
                (self.future.set_exception if error else self.future.set_result)(value)

        self.loop.call_soon_threadsafe(set_it)


class AsyncPoolingEngine:
    is_pooling = True

    def __init__(self, engine: PoolingEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._adds: list[_Call] = []
        self._aborts: list[str] = []
        self._calls: dict[str, _Call] = {}  # request id -> its call (engine thread only)
        self._stop = False
        self._dead: BaseException | None = None
        self._died = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jaxlm-pooling-loop", daemon=True)
        self._thread.start()

    # ----- what the server reads -------------------------------------------------------------
    @property
    def engine_config(self) -> Any:
        return self.engine.engine_config

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive() and not self._stop

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def get_stats(self) -> dict[str, Any]:
        stats = self.engine.get_stats()
        with self._cv:
            stats["num_requests_running"] = len(self._calls)
        return stats

    def check_queue_room(self, num_seqs: int) -> None:
        """The generation routes ask this first; their handlers then refuse the request (400)."""

    def wait_until_dead(self, timeout: float | None = None) -> bool:
        return self._died.wait(timeout)

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"pooling engine loop died: {self._dead!r}")

    def shutdown(self, abort_requests: bool = True, timeout: float | None = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ----- calls --------------------------------------------------------------------------------
    async def encode(self, prompts: Sequence[PoolingPrompt], params: PoolingParams | Sequence[PoolingParams],
                     task: str) -> list[PoolingRequestOutput]:
        """Every prompt's output, in order; raises InvalidRequestError before anything is queued."""
        if not self.is_running:
            raise EngineDeadError("the pooling engine is not running")
        reqs = await asyncio.to_thread(self.engine.process_requests, list(prompts), params, task)
        loop = asyncio.get_running_loop()
        call = _Call(reqs, loop, loop.create_future())
        with self._cv:
            self._adds.append(call)
            self._cv.notify()
        try:
            return await call.future
        except asyncio.CancelledError:  # the client went away: its requests leave the queue
            with self._cv:
                self._aborts.extend(call.ids)
                self._cv.notify()
            raise

    # ----- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._adds or self._aborts or self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stop:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                for call in adds:
                    try:
                        self.engine.add_requests(call.reqs)
                        self._calls.update((rid, call) for rid in call.ids)
                    except ValueError as e:
                        call.resolve(e, error=True)
                if aborts:
                    self.engine.abort_requests(aborts)
                    for rid in aborts:
                        self._calls.pop(rid, None)
                for out in self.engine.step():
                    call = self._calls.pop(out.request_id, None)
                    if call is None:
                        continue
                    call.outputs[out.request_id] = out
                    if len(call.outputs) == len(call.ids):
                        call.resolve([call.outputs[i] for i in call.ids])
        except BaseException as e:  # noqa: BLE001 - every open call learns the engine died
            logger.exception("the pooling engine loop died")
            self._dead = e
            for call in {id(c): c for c in self._calls.values()}.values():
                call.resolve(EngineDeadError(f"pooling engine loop died: {e!r}"), error=True)
            self._died.set()
        else:
            err = EngineDeadError("the server is shutting down")
            for call in {id(c): c for c in self._calls.values()}.values():
                call.resolve(err, error=True)
