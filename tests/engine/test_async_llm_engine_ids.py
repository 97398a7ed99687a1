"""AsyncLLMEngine keys requests by internal id: a client id reused while the old request's abort
is still queued never receives the old request's tokens (issue 17, item 3), forced step by step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers.tiny_tokenizer import add_tiny_tokenizer
from tests.serve.fake_engine import FakeLLMEngine

pytestmark = pytest.mark.timeout(60)


class GatedEngine(FakeLLMEngine):
    """Each step() announces itself on `entered` and waits for one `permit` while gated, so the
    test decides exactly what the engine thread has done when."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gated = True
        self.entered = threading.Semaphore(0)
        self.permit = threading.Semaphore(0)

    def step_routed(self, timeout=None):
        if self.gated:
            self.entered.release()
            self.permit.acquire()
        return super().step_routed(timeout)


@pytest.fixture
def engine(tmp_path):
    tok_dir = add_tiny_tokenizer(tmp_path / "tok")
    eng = AsyncLLMEngine(lambda: GatedEngine(tok_dir, max_model_len=64, step_delay=0.0))
    yield eng
    eng.engine.gated = False
    eng.engine.permit.release()
    eng.shutdown()


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.outputs[0].token_ids]


def test_reused_id_while_abort_is_queued_sees_none_of_the_old_tokens(engine):
    fake: GatedEngine = engine.engine

    async def main():
        old = engine.generate([1, 2], _params(40), "same")
        first = asyncio.ensure_future(old.__anext__())
        await asyncio.to_thread(fake.entered.acquire)  # step 1 (the old request) has begun
        fake.permit.release()
        assert _tokens([await first]) == fake.cycle[3:4]  # greedy fake: offset = sum(prompt)
        # Step 2 has begun: the engine thread holds the old request and will output for it.
        await asyncio.to_thread(fake.entered.acquire)
        await old.aclose()  # the client goes away: the abort is queued, not processed
        new = engine.generate([7], _params(5), "same")
        new_first = asyncio.ensure_future(new.__anext__())
        for _ in range(1000):  # until the new request's add is queued behind the abort
            await asyncio.sleep(0)
            with engine._cv:
                if len(engine._commands) == 2:
                    break
        with engine._cv:
            assert [type(c).__name__ for c in engine._commands] == ["AbortCommand", "AddCommand"]
        fake.gated = False
        fake.permit.release()  # step 2 returns the old request's token, then abort, then add
        outputs = [await new_first] + [o async for o in new]
        return outputs

    outputs = asyncio.run(main())
    assert _tokens(outputs) == fake.cycle[7:12]  # only its own tokens, from its own start
    assert outputs[-1].finished and all(o.request_id == "same" for o in outputs)
