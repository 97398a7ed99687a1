"""AsyncLLMEngine over FakeLLMEngine: errors reach only their caller, cancel aborts, death fails all."""

from __future__ import annotations

import asyncio

import pytest

from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.engine.exceptions import EngineDeadError
from jaxlm.sampling_params import RequestOutputKind, SamplingParams
from tests.serve.conftest import wait_for
from tests.serve.fake_engine import FakeLLMEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine(tiny_tokenizer_dir):
    eng = AsyncLLMEngine(lambda: FakeLLMEngine(tiny_tokenizer_dir, max_model_len=32, step_delay=0.002))
    yield eng
    eng.shutdown()


def _params(max_tokens: int = 5, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kw)


async def _collect(engine, prompt, params, rid):
    return [o async for o in engine.generate(prompt, params, rid)]


def test_bad_request_fails_alone(engine):
    async def main():
        return await asyncio.gather(
            _collect(engine, [1, 2, 3], _params(), "good"),
            _collect(engine, list(range(3, 60)), _params(), "too-long"),
            return_exceptions=True)

    good, bad = asyncio.run(main())
    assert isinstance(bad, ValueError) and "max_model_len" in str(bad)
    assert good[-1].finished and sum(len(o.outputs[0].token_ids) for o in good) == 5
    assert engine.is_running


def test_cancel_aborts_and_duplicate_ids_are_both_served(engine):
    async def main():
        task = asyncio.ensure_future(_collect(engine, [1, 2], _params(max_tokens=10_000), "long"))
        await asyncio.sleep(0.05)
        # A second live request with the same client id runs on its own (internal ids differ).
        second = await _collect(engine, [7], _params(), "long")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return second

    second = asyncio.run(main())
    cycle = engine.engine.cycle
    assert [t for o in second for t in o.outputs[0].token_ids] == cycle[7:12]
    assert all(o.request_id == "long" for o in second)
    assert wait_for(lambda: not engine.engine.has_unfinished_requests(), 5)
    assert engine.get_num_unfinished_requests() == 0


def test_engine_death_fails_pending_and_new_requests(engine):
    async def main():
        task = asyncio.ensure_future(_collect(engine, [1, 2], _params(max_tokens=10_000), "r"))
        await asyncio.sleep(0.05)
        engine.engine.fail_on_step = RuntimeError("device lost")
        with pytest.raises(EngineDeadError, match="device lost"):
            await task
        with pytest.raises(EngineDeadError):
            await _collect(engine, [1], _params(), "after")

    asyncio.run(main())
    assert not engine.is_running and engine.errored


def test_shutdown_fails_pending(engine):
    async def main():
        task = asyncio.ensure_future(_collect(engine, [1, 2], _params(max_tokens=10_000), "r"))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="stopped"):
            await task

    asyncio.run(main())
    assert not engine.is_running


def test_init_error_reaches_constructor():
    def broken():
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        AsyncLLMEngine(broken)
