"""The server's engine-core process started early (engine/core_launcher.py): launch() hands the
resolved config to the process already running, which builds the core (here it fails on a missing
model and reports that, as a freshly spawned core does); an unused process is ended; a client that
needs no single child process (in-process core) ends the early one."""

from __future__ import annotations

import time

import pytest

from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.core_client import EngineCoreClient, SyncMPClient
from jaxlm.engine.core_launcher import CoreLauncher

pytestmark = pytest.mark.timeout(300)


def _config(tmp_path):
    return EngineArgs(model=str(tmp_path / "no-such-model"), max_model_len=64).create_engine_config()


def test_launched_process_builds_the_core_and_unused_one_ends(tmp_path):
    launcher = CoreLauncher()
    pid = launcher.process.pid
    with pytest.raises(RuntimeError, match="engine core 0 failed to start"):
        SyncMPClient(_config(tmp_path), {}, launcher)
    launcher.process.join(30)
    assert launcher.process.pid == pid and launcher.process.exitcode == 1  # it ran run_engine_core
    with pytest.raises(RuntimeError, match="already launched"):
        launcher.launch()

    unused = CoreLauncher()
    time.sleep(0.5)
    assert unused.process.is_alive()
    unused.cancel()
    assert not unused.process.is_alive()


def test_client_without_a_child_process_cancels_the_early_one(tmp_path):
    class Recorder:
        cancelled = 0

        def cancel(self) -> None:
            self.cancelled += 1

        def launch(self, *args):
            raise AssertionError("an in-process core must not launch the early process")

    recorder = Recorder()
    with pytest.raises(Exception, match="no-such-model"):
        EngineCoreClient.make_client(_config(tmp_path), False, None, recorder)
    assert recorder.cancelled == 1
