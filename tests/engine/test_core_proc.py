"""The engine core in its own process (EngineCoreProc behind SyncMPClient) and data-parallel cores
behind one front end (DPLBSyncMPClient): outputs equal the in-process engine's, the least loaded
core gets each new request, and every core's KV cache is free again afterwards."""

from __future__ import annotations

import time

import psutil
import pytest

from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.core_client import DPLBSyncMPClient, InprocClient, SyncMPClient
from jaxlm.engine.llm_engine import LLMEngine
from jaxlm.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)


def _args(path: str, **kw) -> EngineArgs:
    return EngineArgs(model=path, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                      num_gpu_blocks_override=64, token_buckets=[16, 64], seq_buckets=[8], seed=0, **kw)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import make_tiny_engine_model

    return make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def inproc(model_path) -> LLMEngine:
    return LLMEngine.from_engine_args(_args(model_path))


@pytest.fixture(scope="module")
def dp2(model_path):
    engine = LLMEngine.from_engine_args(_args(model_path, data_parallel_size=2), multiprocess=True)
    yield engine
    pids = [c.process.pid for c in engine.engine_core.cores]
    engine.shutdown()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def _prompt(i: int) -> list[int]:
    return [5 + i % 50, 9 + i % 7, 17, 33 + i % 11]


def _params(max_tokens: int = 6, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def _run(engine: LLMEngine, ids: list[str]) -> dict[str, list[list[int]]]:
    done: dict[str, list[list[int]]] = {}
    deadline = time.monotonic() + 300
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for iid, out in engine.step_routed(timeout=1.0):
            if out.finished:
                done[iid] = [o.token_ids for o in out.outputs]
    return {i: done[i] for i in ids}


def _generate(engine: LLMEngine, num: int) -> tuple[list[list[list[int]]], list[int]]:
    """Outputs of num requests added at once (every 8th with n=2), and each one's core."""
    ids, cores = [], []
    for i in range(num):
        ids.append(engine.add_request(str(i), _prompt(i), _params(n=2 if i % 8 == 0 else 1)))
        owner = getattr(engine.engine_core, "_owner", {})
        cores.append(owner.get(f"0_{ids[-1]}", owner.get(ids[-1], 0)))
    done = _run(engine, ids)
    return [done[i] for i in ids], cores


def _wait_idle_stats(engine: LLMEngine) -> None:
    """Take heartbeats until every core reports an empty KV cache."""
    deadline = time.monotonic() + 30
    while any(s.kv_cache_usage > 0 or s.num_running_reqs for s in engine.engine_core.get_scheduler_stats()):
        assert time.monotonic() < deadline, engine.engine_core.get_scheduler_stats()
        engine.step_routed(timeout=1.0)


def test_clients_by_mode(inproc, dp2):
    assert isinstance(inproc.engine_core, InprocClient)
    assert isinstance(dp2.engine_core, DPLBSyncMPClient) and isinstance(dp2.engine_core, SyncMPClient)
    assert dp2.engine_core.num_engines == 2
    # The cores are children of this process, each its own process.
    children = {p.pid for p in psutil.Process().children()}
    assert {c.process.pid for c in dp2.engine_core.cores} <= children
    with pytest.raises(RuntimeError, match="another process"):
        dp2.get_model_runner()


def test_dp2_splits_64_requests_and_matches_the_inproc_engine(inproc, dp2):
    expected, _ = _generate(inproc, 64)
    got, cores = _generate(dp2, 64)
    assert got == expected
    share = cores.count(0) / len(cores)
    assert 0.25 <= share <= 0.75, cores
    _wait_idle_stats(dp2)
    stats = dp2.get_stats()
    assert len(stats["engines"]) == 2 and stats["kv_cache_usage_perc"] == 0.0
    assert all(s.prefix_cache_queries > 0 for s in stats["engines"])  # both did work


def test_dp_balances_by_load_not_by_turn(dp2):
    client = dp2.engine_core
    long_id = dp2.add_request("long", _prompt(1), _params(max_tokens=50))
    assert client._owner[long_id] == 0
    short_id = dp2.add_request("short", _prompt(2), _params(max_tokens=2))
    assert client._owner[short_id] == 1
    deadline = time.monotonic() + 60
    finished = set()
    while short_id not in finished or client.cores[1].load:  # core 1 idle again, core 0 still busy
        assert time.monotonic() < deadline
        finished |= {iid for iid, out in dp2.step_routed(timeout=1.0) if out.finished}
    assert long_id not in finished and client.cores[0].load == 1
    # Turn-taking would give core 0 the next one; it is busy, so core 1 gets it.
    next_id = dp2.add_request("next", _prompt(3), _params(max_tokens=2))
    assert client._owner[next_id] == 1
    _run(dp2, [long_id, next_id])

