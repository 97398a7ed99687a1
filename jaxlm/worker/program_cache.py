"""The compiled step programs kept whole on disk, so a warm start loads them without tracing.

JAX's persistent compilation cache (executor/compilation_cache.py) is keyed by the lowered
program: a restart still traces and lowers each of the ~40 step programs to find its entry,
which was most of a warm start (about 60% of the programs' time, the rest loading them).
This cache keeps the serialized executables of one runner in one file, keyed instead by what
the tracing reads: the Python source of jaxlm and the kernel packages, the resolved attention
backend, the jax/jaxlib/flax versions and JAX's numerics flags, the devices, the whole engine config (model config, buckets, dtype, backend, LoRA, ...), the
parameter and KV cache specs and the bucket lists. Any change there is a new file; a file that
fails to load is removed (the programs are compiled).
Only programs XLA compiled in this process can be written: an executable JAX loaded from its own
cache comes out of serialization without its functions on XLA:CPU (jaxlib 0.10.2: "Function ...
not found" when run in the next process). So a start whose programs came from JAX's cache (a
first start stopped before its background compiles ended, a jaxlm change that leaves the lowered
programs alone) compiles those again with compile_fresh(), past JAX's cache, in the background
(compile_in_background) and then writes the file; without a background thread it writes none.
It lives beside the compilation cache (`<compilation cache>/jaxlm-programs/`) and is off with
it; only a single process that sees one device uses it (a loaded executable binds to every
local device, and the device assignment is not part of the key). The newest few entries are kept (a load refreshes its file's time), older ones removed.

Loading is most of a warm start (XLA:CPU links each program's object files: ~1.5 s per body
program of SmolLM2). With `defer`, load() only reads the file; each program is loaded on its
first use, or earlier by DeferredLoads.load_next(), which the engine core calls while it idles
(a served request waits for at most the one program being loaded and those it needs itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import jax
from jax._src import config as jax_config  # a thread's own persistent-cache threshold (compile_fresh)
from jax.experimental import serialize_executable

from jaxlm.attention.backends import resolve_backend_name
from jaxlm.config import EngineConfig

if TYPE_CHECKING:
    from jaxlm.worker.background_compile import CompileJob

logger = logging.getLogger(__name__)

_FORMAT = 1  # bump when the file's layout changes
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_KEEP = 4  # entries kept per directory (a changed config or jaxlm leaves its old one behind; ~110 MB for SmolLM2)
# An XLA option at its default value: the program is the same, JAX's cache key is not, so XLA compiles it.
_FRESH_OPTIONS = {"xla_embed_ir_in_executable": False}


def compile_fresh(lowered: Any, options: dict[str, Any] | None = None) -> Any:
    """`lowered` compiled by XLA (with `options`), never loaded from JAX's cache, so that it can be
    serialized (see the module docstring); nor written there under its other key (this thread only)."""
    with jax_config.persistent_cache_min_compile_time_secs(float("inf")):
        return lowered.compile(compiler_options={**(options or {}), **_FRESH_OPTIONS})


def code_fingerprint() -> str:
    """A hash of every source file the programs are traced from: jaxlm's and the kernels'."""
    import kernels_cpu
    import kernels_pallas

    jaxlm_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for root in (jaxlm_root, os.path.dirname(kernels_pallas.__file__), os.path.dirname(kernels_cpu.__file__)):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, os.path.dirname(root)).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _spec(leaves: list[Any]) -> list[tuple]:
    return [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]


def program_key(config: EngineConfig, param_leaves: list[Any], kv_caches: list[Any], programs: Any) -> str:
    """The cache key of a runner's programs (see the module docstring)."""
    import flax
    import jaxlib

    # When the programs load or compile is not what they are: a server and LLM share one entry.
    config = dataclasses.replace(config, compilation_config=dataclasses.replace(
        config.compilation_config, defer_program_load=False, compile_in_background=False))
    backend = jax.devices()[0].client
    parts = (
        _FORMAT, code_fingerprint(), jax.__version__, jaxlib.__version__, flax.__version__,
        backend.platform, backend.platform_version, [d.device_kind for d in jax.devices()],
        jax.process_count(), os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64,
        str(jax.config.jax_default_matmul_precision), repr(config),
        # auto's choice depends on the host (a C++ compiler): programs of one never load as the other's
        resolve_backend_name(config.attention_backend),
        _spec(param_leaves), _spec(kv_caches), repr(programs),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


class ProgramCache:
    """One runner's programs in one file: load() them, or save() them once compiled."""

    def __init__(self, path: str | None):
        self.path = path  # None: off (load() finds nothing, save() writes nothing)
        self.jax_cache_hits = 0  # programs compiled under watch_compiles() that JAX loaded from its cache
        self.from_jax_cache: set[tuple[str, Any]] = set()  # (table, key) run by compile(): not serializable yet
        self.num_programs = 0  # in the file load() read

    @classmethod
    def for_runner(cls, config: EngineConfig, mesh: Any, param_leaves: list[Any], kv_caches: list[Any],
                   programs: Any) -> ProgramCache:
        """The runner's cache file; off when the compilation cache is, or when the process sees
        several devices or runs with others."""
        cache_dir = config.compilation_config.resolved_cache_dir()
        # Several local devices: a loaded executable binds to all of them, not to the runner's one.
        if cache_dir is None or jax.process_count() > 1 or jax.local_device_count() > 1 or (
                mesh is not None and mesh.size > 1):
            return cls(None)
        key = program_key(config, param_leaves, kv_caches, programs)
        return cls(os.path.join(cache_dir, "jaxlm-programs", f"{key}.pkl"))

    def load(self, defer: Callable[[str, Any], Any] | None = None) -> dict[str, Any] | None:
        """{name: value} as saved, each compiled program loaded; None when absent or unreadable.
        defer: load none of the programs now: each table is a DeferredPrograms, and "deferred"
        a DeferredLoads that loads them in the order of defer(name, key) (smallest first). The
        first program in that order is loaded here, so a file this jax cannot load is found now."""
        if self.path is None or not os.path.exists(self.path):
            return None
        try:
            with open(self.path, "rb") as f:
                saved = pickle.load(f)
            if saved.get("format") != _FORMAT:
                return None
            out = dict(saved["values"])
            if defer is None:
                for name, table in saved["programs"].items():
                    out[name] = {key: _deserialize(blob) for key, blob in table.items()}
            else:
                tables = {name: DeferredPrograms(table, self.path) for name, table in saved["programs"].items()}
                out.update(tables, deferred=DeferredLoads(tables, defer))
                out["deferred"].load_next()
        except Exception as e:  # a torn or foreign file: removed, compiled as if absent
            logger.warning("removing the unreadable program cache %s (%s: %s)", self.path, type(e).__name__, e)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return None
        os.utime(self.path)  # recently used: kept by prune()
        self.num_programs = sum(map(len, saved["programs"].values()))
        logger.info("%s %d compiled programs from %s", "found" if defer else "loaded", self.num_programs, self.path)
        return out

    @contextlib.contextmanager
    def watch_compiles(self) -> Iterator[None]:
        """Counts, in jax_cache_hits, the programs compiled inside that came from JAX's cache."""
        def on_event(name: str, **_: Any) -> None:
            if name == _HIT_EVENT:
                self.jax_cache_hits += 1

        jax.monitoring.register_event_listener(on_event)
        try:
            yield
        finally:
            jax.monitoring.unregister_event_listener(on_event)

    def compile(self, job: CompileJob) -> list[CompileJob]:
        """Runs `job` (inside watch_compiles()); returns [the job again, fresh] when JAX loaded its
        program from its cache and the file is on: compiled again, it can be saved."""
        hits = self.jax_cache_hits
        job()
        name = (job.table, job.key)
        if job.fresh:
            self.from_jax_cache.discard(name)
        elif self.jax_cache_hits > hits and self.path is not None:
            self.from_jax_cache.add(name)
            return [job.again()]
        return []

    def save(self, programs: dict[str, dict[Any, Any]], values: dict[str, Any]) -> None:
        """Writes the compiled `programs` ({name: {key: Compiled}}) and plain `values`
        atomically (a reader never sees half a file). Failing to write only logs."""
        if self.path is None:
            return
        if self.from_jax_cache:
            logger.info("program cache not written: %d programs came from JAX's compilation cache, which XLA:CPU "
                        "cannot serialize again (compile_in_background compiles them again)", len(self.from_jax_cache))
            return
        try:
            table = {name: {key: serialize_executable.serialize(c) for key, c in t.items()}
                     for name, t in programs.items()}
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            blob = pickle.dumps({"format": _FORMAT, "programs": table, "values": values}, pickle.HIGHEST_PROTOCOL)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            prune(os.path.dirname(self.path), _KEEP)
            logger.info("program cache written: %d programs to %s", sum(map(len, table.values())), self.path)
        except Exception as e:
            logger.warning("could not write the program cache %s (%s: %s)", self.path, type(e).__name__, e)


def _deserialize(blob: tuple) -> Any:
    return serialize_executable.deserialize_and_load(*blob)


class DeferredPrograms(dict):
    """A table of programs {key: Compiled} whose entries are loaded on first lookup."""

    def __init__(self, blobs: dict[Any, tuple], path: str) -> None:
        super().__init__()
        self.blobs = dict(blobs)  # not loaded yet
        self.path = path
        self.seconds = 0.0  # spent loading

    def __missing__(self, key: Any) -> Any:
        blob = self.blobs.pop(key)  # KeyError: no such program, as for a dict
        start = time.perf_counter()
        try:
            program = _deserialize(blob)
        except Exception:
            # Validated at start-up by its first program: a failure now is a damaged file.
            logger.exception("a program of %s failed to load: the file is removed", self.path)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        self.seconds += time.perf_counter() - start
        self[key] = program
        return program


class DeferredLoads:
    """The programs still to load from DeferredPrograms tables, in a fixed order."""

    def __init__(self, tables: dict[str, DeferredPrograms], order: Callable[[str, Any], Any]) -> None:
        self.queue = sorted(((name, key) for name, t in tables.items() for key in t.blobs),
                            key=lambda nk: order(*nk), reverse=True)  # popped from the end
        self.tables = tables
        self.announced = False

    def pending(self) -> int:
        return sum(len(t.blobs) for t in self.tables.values())

    def load_next(self) -> bool:
        """Loads the next program not loaded yet; False when none is left."""
        loaded = False
        while self.queue and not loaded:
            name, key = self.queue.pop()
            if key in self.tables[name].blobs:  # not loaded on use meanwhile
                self.tables[name][key]  # noqa: B018 - the lookup loads it
                loaded = True
        if not self.announced and not self.pending():  # said once, whichever way the last one loaded
            self.announced = True
            logger.info("all deferred programs loaded (%.1f s of loading)", sum(t.seconds for t in self.tables.values()))
        return loaded


def prune(directory: str, keep: int) -> None:
    """Removes all but the `keep` most recently used entries of `directory`."""
    entries = sorted((e for e in os.scandir(directory) if e.name.endswith(".pkl")),
                     key=lambda e: e.stat().st_mtime, reverse=True)
    for e in entries[keep:]:
        try:
            os.unlink(e.path)
        except FileNotFoundError:  # another engine pruned it first
            pass
