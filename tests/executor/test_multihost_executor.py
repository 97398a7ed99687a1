"""Several hosts on one machine: two processes (gloo, one CPU device each), TP=2 over both.

Rank 0 is tests/helpers/multihost_cases.py (AsyncLLMEngine), the follower the real
``python -m jaxlm.serve --headless``. Three pairs start at once (module fixture): the first
checks the tokens against one device and then loses its follower (SIGKILL) while serving; the
second loses its rank 0; the third loses its follower while idle. Every process is killed at
the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxlm.config import ParallelConfig
from jaxlm.executor.abstract import Executor
from tests.helpers import tiny_models as tm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 240
LOST_WITHIN_S = 10


def free_port_triple() -> int:
    """A port p with p, p+1 and p+2 free (the coordinator and the two channel ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 2 >= 65535:
            continue
        try:
            for p in (port, port + 1, port + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no three consecutive free ports")


class Pair:
    def __init__(self, model: str, work: str, *extra: str):
        self.work = work
        port = free_port_triple()
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for name in ("XLA_FLAGS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
            env.pop(name, None)

        def spawn(args: list[str], log: str) -> subprocess.Popen:
            with open(os.path.join(work, log), "w") as out:
                return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out,
                                        stderr=subprocess.STDOUT)

        self.rank0 = spawn(["-m", "tests.helpers.multihost_cases", model, str(port), work, *extra], "rank0.log")
        self.follower = spawn(["-m", "jaxlm.serve", model, "--headless", "--nnodes", "2", "--node-rank", "1",
                               "--master-port", str(port)], "follower.log")

    def log(self, name: str) -> str:
        with open(os.path.join(self.work, name)) as f:
            return f.read()[-3000:]

    def wait_results(self, deadline: float) -> dict:
        path = os.path.join(self.work, "results.json")
        while not os.path.exists(path):
            if time.monotonic() > deadline or self.rank0.poll() is not None or self.follower.poll() is not None:
                pytest.fail(f"the pair did not serve: rank 0 {self.log('rank0.log')}\n"
                            f"follower {self.log('follower.log')}")
            time.sleep(0.2)
        time.sleep(0.2)  # written in one go; let it land
        with open(path) as f:
            return json.load(f)

    def kill(self) -> None:
        for proc in (self.rank0, self.follower):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    work = tmp_path_factory.mktemp("multihost")
    model = tm.make_tiny_engine_model("llama", work / "llama")
    for name in "abc":
        (work / name).mkdir()
    started = [Pair(model, str(work / "a"), "--reference"), Pair(model, str(work / "b")),
               Pair(model, str(work / "c"), "--idle")]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        yield [(pair, pair.wait_results(deadline)) for pair in started]
    finally:
        for pair in started:
            pair.kill()


def test_two_processes_give_the_tokens_of_one(pairs):
    _, results = pairs[0]
    assert results["tokens"] == results["reference"]  # prompt 2 under a regex: the same masks
    assert all(len(t) > 0 for t in results["tokens"])
    assert results["compiles"] == 0  # warm-up in lock-step; step inputs placed without a program


def test_killed_follower_kills_the_engine(pairs):
    pair, _ = pairs[0]
    pair.follower.send_signal(signal.SIGKILL)
    pair.rank0.wait(timeout=LOST_WITHIN_S)  # the helper exits once its open request failed
    with open(os.path.join(pair.work, "error.json")) as f:
        error = json.load(f)
    assert error["type"] == "EngineDeadError", error
    assert "follower node" in error["message"], error


def test_killed_follower_of_an_idle_engine_ends_rank0(pairs):
    pair, _ = pairs[2]
    pair.follower.send_signal(signal.SIGKILL)
    assert pair.rank0.wait(timeout=LOST_WITHIN_S) == 1
    assert "a follower node closed its connection" in pair.log("rank0.log")


def test_killed_rank0_ends_the_follower(pairs):
    pair, _ = pairs[1]
    pair.rank0.send_signal(signal.SIGKILL)
    assert pair.follower.wait(timeout=LOST_WITHIN_S) != 0
    log = pair.log("follower.log")
    # Ours (exit 1), unless JAX's client saw the coordinator's socket close first (abort).
    assert ("rank 0 closed its connection" in log
            or "JAX distributed service detected fatal errors" in log), log


# ---- configuration (no processes) ------------------------------------------------------------

def test_multinode_flags_and_jax_environment(monkeypatch):
    with pytest.raises(ValueError, match="node_rank=2 must be in"):
        ParallelConfig(nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="--headless is for the nodes with --node-rank > 0"):
        ParallelConfig(nnodes=2, headless=True)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    p = ParallelConfig()
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (3, 2, "10.0.0.1", 1234)
    # Flags win over the environment.
    assert ParallelConfig(nnodes=2, node_rank=1).nnodes == 2
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "nohostport")
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS=host:port"):
        ParallelConfig()


def test_only_rank0_runs_an_engine():
    class Config:
        parallel_config = ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=1)

    with pytest.raises(ValueError, match="--headless"):
        Executor.get_class(Config())
    Config.parallel_config = ParallelConfig(tensor_parallel_size=2, nnodes=2)
    assert Executor.get_class(Config()).__name__ == "MultiHostExecutor"
