"""The runner's programs as compile jobs: one callable per program, run at warm-up under one
progress bar (ModelRunner.warm_up; a speculative runner adds its draft model's jobs), or some
after it in a thread (worker/background_compile.py)."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.sample.metadata import SamplerVariant
from jaxlm.worker.background_compile import CompileJob
from jaxlm.worker.buckets import decode_buckets
from jaxlm.worker.command_buffers import GPU_PLATFORMS, compiler_options
from jaxlm.worker.program_cache import compile_fresh
from jaxlm.worker.step_programs import MIXED, abstract

logger = logging.getLogger(__name__)


def compile_lowered(lowered: Any, options: dict[str, Any], fresh: bool) -> Any:
    """The one place a step program is compiled (options: worker/command_buffers.py's)."""
    return compile_fresh(lowered, options) if fresh else lowered.compile(compiler_options=options or None)


def runner_platform(runner: Any) -> str:
    """The jax platform the runner's programs run on ("cpu", "gpu", ...)."""
    mesh = getattr(runner, "mesh", None)
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def log_cudagraph_mode(runner: Any) -> None:
    """One line at start-up where the mode means nothing (a CPU) or what it set."""
    mode, platform = runner.config.compilation_config.cudagraph_mode, runner_platform(runner)
    if mode is not None and platform not in GPU_PLATFORMS:
        logger.info("cudagraph_mode=%s has no effect on %s: XLA's command buffers exist on GPUs only", mode, platform)
    elif mode is not None:
        logger.info("cudagraph_mode=%s: XLA command buffers per step program (worker/command_buffers.py)", mode)


def program_options(runner: Any) -> Callable[[str, tuple], dict[str, Any]]:
    """(table, key) -> the compiler options of that program under the engine's cudagraph_mode."""
    mode, platform = runner.config.compilation_config.cudagraph_mode, runner_platform(runner)
    # Without decode bodies (the XLA backend) decode steps run the mixed bodies they reach.
    reach = None if runner.decode_buckets else decode_buckets(runner.token_buckets,
                                                              runner.config.scheduler_config.max_num_seqs)
    return lambda table, key: (compiler_options(mode, platform, table, key[1], key[0], reach) if table == "body"
                               else compiler_options(mode, platform, table))


def compile_jobs(runner: Any) -> list[CompileJob]:
    """`runner`: a ModelRunner with its KV cache allocated; each job compiles one program and
    keeps the executable in runner._body / runner._sample. Also sets what the programs share:
    the sampler's param leaves and the device buffer of last sampled tokens."""
    kv_spec, params_spec = abstract(runner.kv_caches), abstract(runner._param_leaves)
    replicated = runner._replicated

    def packed_spec(T: int, kind: str) -> jax.ShapeDtypeStruct:
        size = sum(math.prod(shape) for shape in runner._step_shapes(T, kind).values())
        return jax.ShapeDtypeStruct((size,), jnp.int32, sharding=replicated)

    def mm_spec(T: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """A multimodal model's image rows [T, hidden] (float32), or nothing."""
        if runner.encoder is None:
            return ()
        return (jax.ShapeDtypeStruct((T, runner.encoder.hidden_size), jnp.float32, sharding=replicated),)

    body_jit = lambda T, kind: jax.jit(runner._body_fn(T, kind), donate_argnums=(1,))  # noqa: E731
    T0 = runner.token_buckets[0]
    hidden_sel = jax.eval_shape(body_jit(T0, MIXED), params_spec, kv_spec, packed_spec(T0, MIXED),
                                jax.ShapeDtypeStruct((runner.sample_capacity,), jnp.int32), *mm_spec(T0))[0]
    hidden_sel = jax.ShapeDtypeStruct(hidden_sel.shape, hidden_sel.dtype, sharding=replicated)
    runner._find_sampler_leaves(params_spec, hidden_sel)
    sampler_spec = [params_spec[i] for i in runner._sampler_leaf_index]
    runner._last_tokens = runner._put(np.zeros(runner.sample_capacity, np.int32))
    tokens_spec = jax.ShapeDtypeStruct((runner.sample_capacity,), jnp.int32, sharding=replicated)
    options = program_options(runner)

    def body(key: tuple[int, str], fresh: bool) -> None:
        lowered = body_jit(*key).lower(params_spec, kv_spec, packed_spec(*key), tokens_spec, *mm_spec(key[0]))
        runner._body[key] = compile_lowered(lowered, options("body", key), fresh)

    def sampler(key: tuple[int, SamplerVariant], fresh: bool) -> None:
        md = runner.sampling.build_host([], *key)
        md_spec = jax.ShapeDtypeStruct(md.packed().shape, jnp.int32, sharding=replicated)
        lowered = jax.jit(runner._sample_fn(key[0], md)).lower(sampler_spec, hidden_sel, md_spec)
        runner._sample[key] = compile_lowered(lowered, options("sample", key), fresh)

    def job(table: str, key: tuple, compile_fn: Callable[[tuple, bool], None]) -> CompileJob:
        return CompileJob(table, key, lambda fresh: compile_fn(key, fresh))

    jobs = [job("body", (T, kind), body) for kind, buckets in runner.body_buckets().items() for T in buckets]
    return jobs + [job("sample", (S, v), sampler) for S in runner.seq_buckets for v in runner.sampling.variants()]
