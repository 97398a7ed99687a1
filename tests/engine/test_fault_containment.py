"""Fault containment (issue 17): a failure traced to one request (its sampling inputs, its
output processing) fails that request alone with finish_reason "error" while the batch goes on
unchanged; a failure in the model step kills the engine and every open request gets the error."""

from __future__ import annotations

import asyncio

import pytest

from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.engine.exceptions import EngineDeadError, EngineGenerateError
from jaxlm.engine.llm_engine import LLMEngine
from jaxlm.engine.output_processor import RequestState
from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.timeout(300)
PROMPTS = {"a": [5, 9, 17, 33], "bad": [7, 8, 9], "c": [40, 41, 42, 43, 44]}


def _args(path: str) -> EngineArgs:
    return EngineArgs(model=path, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                      num_gpu_blocks_override=64, token_buckets=[32], seq_buckets=[8], seed=0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import make_tiny_engine_model

    return make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def engine(model_path) -> LLMEngine:
    """Shared by the module's tests and their front ends: a front end's shutdown (which frees an
    engine's device memory) must not end it, so only the module's teardown does."""
    eng = LLMEngine.from_engine_args(_args(model_path))
    shutdown, eng.shutdown = eng.shutdown, lambda: None
    yield eng
    shutdown()


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(engine: LLMEngine, ids: list[str]) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Client id -> (tokens, finish reason, recorded error) after running every request to its end."""
    internal = {engine.add_request(rid, PROMPTS[rid], _params()): rid for rid in ids}
    done = {}
    for _ in range(200):
        for iid, out in engine.step_routed():
            if out.finished:
                done[internal[iid]] = (out.outputs[0].token_ids, out.outputs[0].finish_reason,
                                       engine.pop_request_error(iid))
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.make_stats().num_running_reqs == 0
    return done


def _check_only_bad_failed(engine: LLMEngine, baseline, result, where: str) -> None:
    assert result["bad"][1] == "error" and result["bad"][0] == []
    assert "injected" in result["bad"][2] and where in result["bad"][2]
    assert result["a"] == baseline["a"] and result["c"] == baseline["c"]  # the batch went on unchanged
    assert _run(engine, ["a"])["a"] == baseline["a"]  # and the engine keeps serving


def test_sampling_input_fault_fails_only_that_request(engine, monkeypatch):
    baseline = _run(engine, ["a", "c"])
    assert baseline["a"][1] == "length" and len(baseline["a"][0]) == 6
    real_add = SamplingInputBuilder.add_request

    def add_request(self, req_id, params, *args, **kwargs):
        if req_id.startswith("bad") and params.max_tokens == 6:  # not the runner's stand-in
            raise OverflowError("injected: sampling inputs")
        return real_add(self, req_id, params, *args, **kwargs)

    monkeypatch.setattr(SamplingInputBuilder, "add_request", add_request)
    _check_only_bad_failed(engine, baseline, _run(engine, ["a", "bad", "c"]), "sampling inputs")


def test_output_processing_fault_fails_only_that_request(engine, monkeypatch):
    baseline = _run(engine, ["a", "c"])
    real_completion = RequestState.completion

    def completion(self, *args, **kwargs):
        if self.external_req_id == "bad" and len(self.token_ids) >= 2:  # fails mid-stream
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: detokenize")
        return real_completion(self, *args, **kwargs)

    monkeypatch.setattr(RequestState, "completion", completion)
    result = _run(engine, ["a", "bad", "c"])
    assert engine.scheduler.kv_cache_manager.usage == 0.0  # the failed request's blocks are free
    _check_only_bad_failed(engine, baseline, result, "detokenize")


def test_async_engine_gives_the_error_to_that_caller_only(engine, monkeypatch):
    baseline = _run(engine, ["a", "c"])
    real_completion = RequestState.completion

    def completion(self, *args, **kwargs):
        if self.external_req_id == "bad":
            raise RuntimeError("injected: output")
        return real_completion(self, *args, **kwargs)

    monkeypatch.setattr(RequestState, "completion", completion)
    async_engine = AsyncLLMEngine(lambda: engine)

    async def one(rid: str):
        params = _params()
        params.output_kind = RequestOutputKind.DELTA
        tokens = []
        async for out in async_engine.generate(PROMPTS[rid], params, rid):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        return await asyncio.gather(one("a"), one("bad"), one("c"), return_exceptions=True)

    try:
        a, bad, c = asyncio.run(main())
        assert isinstance(bad, EngineGenerateError) and "injected: output" in str(bad)
        assert a == baseline["a"][0] and c == baseline["c"][0]
        assert async_engine.is_running
    finally:
        async_engine.shutdown()


def test_a_failed_child_stops_its_siblings(engine, monkeypatch):
    real_add = SamplingInputBuilder.add_request

    def add_request(self, req_id, params, *args, **kwargs):
        if req_id.startswith("1_bad") and params.max_tokens != 1:  # the second of n = 2
            raise ValueError("injected: one child")
        return real_add(self, req_id, params, *args, **kwargs)

    monkeypatch.setattr(SamplingInputBuilder, "add_request", add_request)
    async_engine = AsyncLLMEngine(lambda: engine)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
        return [out async for out in async_engine.generate(PROMPTS["bad"], params, "bad")]

    try:
        with pytest.raises(EngineGenerateError, match="injected: one child"):
            asyncio.run(main())
        for _ in range(100):  # the abort of the sibling reaches the engine thread
            if not engine.has_unfinished_requests():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert not engine.has_unfinished_requests()
    finally:
        async_engine.shutdown()


def test_model_step_fault_kills_the_engine_and_fails_every_open_request(model_path):
    # The core in this process, to break its runner (tests/engine/test_core_proc.py kills a core process).
    async_engine = AsyncLLMEngine(lambda: LLMEngine.from_engine_args(_args(model_path)))
    runner = async_engine.engine.get_model_runner()

    def broken_body(*args, **kwargs):
        raise RuntimeError("injected: model body")

    async def main():
        gens = [async_engine.generate(PROMPTS[rid], _params(), rid) for rid in ("a", "c")]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        runner._body = {size: broken_body for size in runner._body}
        return await asyncio.gather(*firsts, return_exceptions=True)

    try:
        errors = asyncio.run(main())
        assert all(isinstance(e, EngineDeadError) and "injected: model body" in str(e) for e in errors)
        assert async_engine.wait_until_dead(10) and async_engine.errored and not async_engine.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(anext(async_engine.generate([1], _params(), "late")))
    finally:
        async_engine.shutdown()
