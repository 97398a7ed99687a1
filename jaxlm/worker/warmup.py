"""How a runner's programs come to be before it serves: loaded from the program cache (each on
first use with defer_program_load), or compiled, all of them before serving, or with
compile_in_background only the serving set first and the rest in a thread
(worker/background_compile.py). Either way the step never compiles (worker/compile_guard.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxlm.worker.background_compile import BackgroundCompiles, background_order
from jaxlm.worker.compile_jobs import log_cudagraph_mode
from jaxlm.worker.program_cache import ProgramCache
from jaxlm.worker.step_programs import load_order

logger = logging.getLogger(__name__)


def warm_up(runner: Any) -> None:
    """`runner`: a ModelRunner with its KV cache allocated."""
    start = time.perf_counter()
    log_cudagraph_mode(runner)
    runner._last_tokens = runner._put(np.zeros(runner.sample_capacity, np.int32))
    cache = program_cache(runner)
    comp = runner.config.compilation_config
    background = 0
    if (saved := cache.load(load_order if comp.defer_program_load else None)) is not None:
        runner._body, runner._sample, runner._sampler_leaf_index = (saved[k] for k in ("body", "sample", "leaf_index"))
        runner.deferred_loads = saved.get("deferred")
        runner.num_programs = runner.programs_from_cache = cache.num_programs
    else:
        jobs = runner.compile_jobs()
        runner.num_programs, later, again = len(jobs), [], []
        in_background = comp.compile_in_background and may_compile_in_background(runner)
        if in_background:
            now = runner.ready.serving_set(jobs)
            later = sorted((j for j in jobs if j not in now), key=background_order)
        if later:
            runner.ready.reset()
            jobs, background = now, len(later)
        with cache.watch_compiles():
            for job in tqdm(jobs, desc="Compiling buckets", unit="program"):
                again += cache.compile(job)
                if background:
                    runner.ready.publish(job)
        if in_background and (later or again):
            # Programs JAX loads from its cache meanwhile (cache.compile) are compiled again at the end.
            runner.background = BackgroundCompiles(later + again, runner.ready, lambda: _save(runner, cache),
                                                   watch=cache.watch_compiles, run_job=cache.compile)
        else:
            _save(runner, cache)
    if runner.encoder is not None:  # the vision encoder's programs, one per image bucket
        runner.num_programs += runner.encoder.compile(runner._param_leaves)
    runner.warmup_seconds = time.perf_counter() - start
    logger.info("Compiled %d programs in %.1f s (%d from the program cache%s%s)", runner.num_programs - background,
                runner.warmup_seconds, runner.programs_from_cache, ", loaded on use" * bool(runner.deferred_loads),
                f"; {background} more compile in the background while serving" * bool(background))
    if cache.from_jax_cache and runner.background is not None:  # else cache.save() said it
        logger.info("%d programs came from JAX's compilation cache: XLA:CPU cannot serialize them again, so they "
                    "compile again in the background for the program cache", len(cache.from_jax_cache))
    if runner.background is not None:
        runner.background.start()


def may_compile_in_background(runner: Any) -> bool:
    """A single process with no draft model: every process of a multi-host engine must pick the
    same programs each step, and a speculative runner's programs are the draft's too."""
    return runner.config.speculative_config is None and jax.process_count() == 1


def _save(runner: Any, cache: ProgramCache) -> None:
    cache.save({"body": runner._body, "sample": runner._sample}, {"leaf_index": runner._sampler_leaf_index})
    if runner.background is not None:
        again = sum(j.fresh for j in runner.background.done)
        logger.info("all %d programs compiled (%d in the background, %.1f s%s)", runner.num_programs,
                    len(runner.background.done) - again, runner.background.seconds,
                    f"; {again} from JAX's compilation cache compiled again for the program cache" * bool(again))


def program_cache(runner: Any) -> ProgramCache:
    # A speculative runner's draft programs live on its drafter, outside this cache: off.
    # A multimodal model's encoder programs live outside it too (worker/encoder_runner.py): off.
    if runner.config.speculative_config is not None or runner.encoder is not None:
        return ProgramCache(None)
    keys = [("body", (T, kind)) for kind, buckets in runner.body_buckets().items() for T in buckets]
    keys += [("sample", (S, v)) for S in runner.seq_buckets for v in runner.sampling.variants()]
    return ProgramCache.for_runner(runner.config, runner.mesh, runner._param_leaves, runner.kv_caches, keys)
