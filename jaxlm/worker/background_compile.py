"""A cold start that serves before every program is compiled (compile_in_background).

Compiling every bucket's program is most of a cold start (SmolLM2 on 2 cores: 15 bodies at
10-20 s each, 24 samplers at ~1 s). Any step fits the largest token bucket's body and the largest
sequence bucket's samplers, so those (and the batch-1 decode body) are compiled first
(ReadyBuckets.serving_set) and the engine starts serving; a thread compiles the rest
(BackgroundCompiles), smallest steps first, and each step takes the smallest bucket compiled so
far that holds it. Until then a step pads further
than it would: slower, never different (the programs compute the same rows whatever the
padding; tests/worker/test_background_compile.py checks the samples). XLA releases the GIL
while it compiles, so the thread costs the serving loop one core, not its turn.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, ContextManager, Iterable, Sequence

from jaxlm.worker.step_programs import DECODE, MIXED, PROMPT_LOGPROBS

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CompileJob:
    """One program: compiling it stores the executable at runner._<table>[key]. A `fresh` job
    compiles a program the runner already serves again, past JAX's cache (program_cache.py)."""

    table: str  # "body" or "sample"
    key: tuple  # (T, kind) or (S, variant)
    run: Callable[[bool], None]  # run(fresh)
    fresh: bool = False

    def __call__(self) -> None:
        self.run(self.fresh)

    def again(self) -> CompileJob:
        return dataclasses.replace(self, fresh=True)


class ReadyBuckets:
    """The buckets whose programs are compiled: per body kind, its token buckets; the sequence
    buckets whose every sampler variant is compiled. All of them until reset(). Lists are
    replaced, never mutated, so the serving thread reads them while the compiling thread publishes."""

    def __init__(self, body_buckets: dict[str, list[int]], seq_buckets: list[int], variants: Sequence[Any]):
        self.body_buckets = {kind: list(b) for kind, b in body_buckets.items()}
        self.seq_buckets = list(seq_buckets)
        self.num_variants = len(variants)
        self.bodies = {kind: list(b) for kind, b in self.body_buckets.items()}
        self.seqs = list(self.seq_buckets)
        self._variants_done: dict[int, int] = {}

    def reset(self) -> None:
        """No program compiled yet: publish() adds them."""
        self.bodies = {kind: [] for kind in self.body_buckets}
        self.seqs, self._variants_done = [], {}

    def serving_set(self, jobs: Iterable[CompileJob]) -> list[CompileJob]:
        """The jobs any step can run on: the largest mixed and prompt-logprobs bodies and every
        sampler variant of the largest sequence bucket; also the smallest mixed body, so that
        one request's decode steps are not padded to the largest bucket meanwhile."""
        sizes = {kind: {b[0], b[-1]} if kind == MIXED else {b[-1]}
                 for kind, b in self.body_buckets.items() if b and kind != DECODE}
        S = self.seq_buckets[-1]
        return [j for j in jobs if (j.key[0] in sizes.get(j.key[1], ()) if j.table == "body" else j.key[0] == S)]

    def publish(self, job: CompileJob) -> None:
        """`job` is compiled (after reset())."""
        if job.table == "body":
            T, kind = job.key
            self.bodies[kind] = sorted(self.bodies[kind] + [T])
            return
        S = job.key[0]
        self._variants_done[S] = self._variants_done.get(S, 0) + 1
        if self._variants_done[S] == self.num_variants:
            self.seqs = sorted(self.seqs + [S])

    def complete(self) -> bool:
        return self.seqs == self.seq_buckets and all(self.bodies[k] == b for k, b in self.body_buckets.items())

    def body(self, kind: str, num_tokens: int) -> tuple[int, str]:
        """(T, kind) of the smallest compiled body holding num_tokens; a decode step falls back
        to the mixed body when no decode body holding it is compiled yet."""
        ready = self.bodies[kind]
        i = bisect.bisect_left(ready, num_tokens)
        if i < len(ready):
            return ready[i], kind
        if kind == DECODE:
            return self.body(MIXED, num_tokens)
        raise ValueError(f"{num_tokens} tokens exceed the largest compiled {kind} bucket ({ready[-1:]})")

    def seq(self, num_rows: int) -> int:
        i = bisect.bisect_left(self.seqs, num_rows)
        if i == len(self.seqs):
            raise ValueError(f"{num_rows} sampled rows exceed the largest compiled sequence bucket ({self.seqs[-1:]})")
        return self.seqs[i]


def background_order(job: CompileJob) -> tuple:
    """Batch-1 decode first (its samplers), then the mixed bodies and samplers by size; decode
    bodies (a kernel backend's faster form) next, prompt logprobs last."""
    size, kind = job.key
    if job.table == "sample":
        return (0, size, 1)
    return ({MIXED: 0, DECODE: 1, PROMPT_LOGPROBS: 2}[kind], size, 0)


def _run_job(job: CompileJob) -> list[CompileJob]:
    job()
    return []


class BackgroundCompiles:
    """A thread that compiles `jobs` in order, publishing each to `ready` (a fresh job's program
    is published already), then calls on_done().
    watch: a context manager factory the compiles run inside (the program cache's).
    run_job: runs a job and returns the jobs it adds at the end (ProgramCache.compile: a program
    JAX loaded from its cache is compiled again)."""

    def __init__(self, jobs: list[CompileJob], ready: ReadyBuckets, on_done: Callable[[], None],
                 watch: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 run_job: Callable[[CompileJob], list[CompileJob]] = _run_job):
        self.jobs = list(jobs)
        self.done: list[CompileJob] = []
        self.watch = watch
        self.run_job = run_job
        self.ready = ready
        self.on_done = on_done
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        return len(self.jobs)

    def start(self) -> None:
        """Starts (or resumes, after stop()) compiling."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="jaxlm-background-compile", daemon=True)
        # Interpreter exit would stop the thread inside XLA (an abort): end it after its program.
        atexit.register(self.stop)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Stops after the program being compiled (waits for it up to `timeout`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the thread to end; True when every job is compiled."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.jobs

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            with self.watch():
                while self.jobs and not self._stop.is_set():
                    job = self.jobs[0]
                    more = self.run_job(job)
                    self.done.append(self.jobs.pop(0))
                    self.jobs += more
                    if not job.fresh:
                        self.ready.publish(job)
        except BaseException as e:  # the engine keeps serving on the programs it has
            self.error = e
            logger.exception("background compilation failed; %d programs left uncompiled", len(self.jobs))
            return
        finally:
            self.seconds += time.perf_counter() - start
            atexit.unregister(self.stop)
        if not self.jobs:
            self.on_done()
