"""Engine shutdown frees the engine's device buffers at once, whoever still refers to the engine
(issue 38: on an H100 a second engine in one process found no memory for its KV cache).

The garbage collector is off while an engine lives here: an engine's objects hold reference
cycles, so only an explicit delete can free its buffers before a collection. The two-engine test
replaces the device's allocator counters with ones computed from the live arrays, which is how a
GPU's allocator counts, so the KV budget follows what the first engine left behind."""

from __future__ import annotations

import gc

import jax
import pytest

from jaxlm.worker import worker as worker_mod
from tests.helpers.tiny_models import make_tiny_engine_model

KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, token_buckets=[8, 32],
          seq_buckets=[4], seed=0)


def _live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()
    gc.collect()


def _generate(llm) -> list[int]:
    from jaxlm import SamplingParams

    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_shutdown_deletes_every_buffer_of_the_engine_and_refuses_new_requests(model_dir, no_gc):
    from jaxlm import LLM
    from jaxlm.engine.exceptions import EngineDeadError

    before = _live_bytes()
    llm = LLM(model=model_dir, num_gpu_blocks_override=16, **KW)
    assert len(_generate(llm)) == 4
    assert _live_bytes() > before  # weights and KV cache
    llm.llm_engine.shutdown()  # `llm` is still referenced and the collector is off
    assert _live_bytes() == before
    with pytest.raises(EngineDeadError, match="shut down"):
        _generate(llm)


def test_two_engines_in_turn_get_the_same_kv_block_count(model_dir, no_gc, monkeypatch):
    from jaxlm import LLM

    # A 64 MiB "device" whose in-use counter is the live arrays, as a GPU allocator reports.
    monkeypatch.setattr(worker_mod, "device_memory_stats",
                        lambda device: {"bytes_limit": 64 << 20, "bytes_in_use": _live_bytes()})
    first = LLM(model=model_dir, gpu_memory_utilization=0.5, **KW)
    blocks = first.llm_engine.engine_config.cache_config.num_gpu_blocks
    tokens = _generate(first)
    first.llm_engine.shutdown()
    second = LLM(model=model_dir, gpu_memory_utilization=0.5, **KW)
    assert second.llm_engine.engine_config.cache_config.num_gpu_blocks == blocks
    assert _generate(second) == tokens
    # Without a shutdown the second engine's buffers still count as in use: the H100's failure.
    in_use = _live_bytes()
    with pytest.raises(ValueError, match="No memory left for the KV cache"):
        LLM(model=model_dir, gpu_memory_utilization=0.5, **KW)
    assert _live_bytes() == in_use  # the failed engine gave its weights back
    second.llm_engine.shutdown()
