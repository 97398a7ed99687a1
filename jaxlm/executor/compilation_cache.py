"""JAX's persistent compilation cache, set up once at engine start (by the executor).

It is process-wide JAX state, so it is configured explicitly in one place rather than as a side
effect of building a worker: a restart (or another engine on the same shapes) then loads the
compiled step programs from disk instead of compiling them again.
"""

from __future__ import annotations

import logging

import jax

from jaxlm.config import CompilationConfig

logger = logging.getLogger(__name__)


def configure_compilation_cache(config: CompilationConfig) -> str | None:
    """Points JAX's persistent cache at ``config.resolved_cache_dir()`` (None = leave it off).

    Every compiled program is kept (no minimum compile time or size): the step programs are
    few and each is seconds to compile. Returns the directory in use. JAX reads the setting
    when it first compiles, so a second engine in the process asking for another directory
    gets a warning and keeps the first.
    """
    cache_dir = config.resolved_cache_dir()
    if cache_dir is None:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current and current != cache_dir:
        logger.warning("compilation cache already at %s in this process; not moving it to %s", current, cache_dir)
        return current
    if current != cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        logger.info("persistent compilation cache: %s", cache_dir)
    return cache_dir
