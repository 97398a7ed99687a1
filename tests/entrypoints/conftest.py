"""One engine under --scheduling-policy priority, shared by the priority and beam-search tests.

Same model and shapes as test_llm_api.py's engine, so its programs come from the compilation cache."""

import pytest

from tests.helpers.tiny_models import make_tiny_engine_model

ENGINE_KWARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=40,
                     seed=0)


@pytest.fixture(scope="package")
def tiny_llama_path(tmp_path_factory):
    return make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="package")
def priority_llm(tiny_llama_path):
    from jaxlm import LLM

    return LLM(model=tiny_llama_path, scheduling_policy="priority", **ENGINE_KWARGS)
