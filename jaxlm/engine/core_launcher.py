"""The server's engine-core process, started before the front end is built.

`python -m jaxlm.serve` used to import fastapi, transformers and the engine, resolve the model and
load the tokenizer, and only then spawn the core, which imported jax, flax and the model code all
over again before it could read a weight: two processes importing one after the other. The
launcher spawns the core's process first thing after the flags are parsed; it imports the core's
modules while the front end imports its own, then waits for run_engine_core's arguments (the
resolved config) over a pipe. The child is the same 'spawn' process the client would start (jax
is not fork-safe), and it inherits the environment from before the front end changes it (see
core_client.prepare_frontend_process), which is what a core gets anyway.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
from typing import Any

logger = logging.getLogger(__name__)

_HF_CONFIG_BASES = ("transformers.configuration_utils", "transformers.utils.type_validators",
                    "transformers.models.auto.auto_factory")
# How long an unused child gets to exit after SIGTERM before it is killed.
_CANCEL_TIMEOUT_S = 5.0


def _preload_and_wait(conn: Any) -> None:
    """The child: the core's imports, then run_engine_core(*args) once the front end sends them."""
    from jaxlm.engine.core import EngineCoreProc, die_with_parent

    die_with_parent()
    # What building the core imports first (the executor, worker, runner, model code, jax, flax),
    # so that it happens while the parent imports the front end.
    import jaxlm.executor.uniproc_executor  # noqa: F401
    import jaxlm.model_loader.loader  # noqa: F401
    import jaxlm.models.registry  # noqa: F401
    import jaxlm.worker.worker  # noqa: F401
    import zmq  # noqa: F401

    # Unpickling the config's transformers class imports what every HF config module needs
    # (torch among it, ~1-2 s): those shared parts now. Internal paths, so only where they exist.
    for name in _HF_CONFIG_BASES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    try:
        args = conn.recv()
    except (EOFError, OSError):  # the front end failed (or went) before it needed a core
        return
    finally:
        conn.close()
    if args is not None:
        EngineCoreProc.run_engine_core(*args)


class CoreLauncher:
    """One engine-core process, started now; launch() hands it run_engine_core's arguments."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        child_conn, self._conn = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_preload_and_wait, args=(child_conn,), name="EngineCore_0", daemon=True)
        self.process.start()
        child_conn.close()
        self._used = False

    def launch(self, *run_engine_core_args: Any) -> Any:
        """The started process, now running EngineCoreProc.run_engine_core(*run_engine_core_args)."""
        if self._used:
            raise RuntimeError("this engine-core process was already launched")
        self._used = True
        self._conn.send(run_engine_core_args)
        self._conn.close()
        return self.process

    def cancel(self) -> None:
        """Ends the process if it was never launched (the front end failed or needs no child)."""
        if self._used:
            return
        self._used = True
        self._conn.close()  # a child already waiting sees EOF and returns
        self.process.terminate()  # one still importing holds nothing worth a clean exit
        self.process.join(_CANCEL_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
