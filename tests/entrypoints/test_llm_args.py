"""LLM(...) takes vLLM's keyword arguments: jaxlm's fields, vLLM's fixed ones at their only value."""

from __future__ import annotations

import pytest

from jaxlm.entrypoints.llm import _engine_args


def test_engine_fields_are_accepted():
    args = _engine_args("m", dict(trust_remote_code=False, revision="main", max_logprobs=3,
                                  kv_cache_memory_bytes=1 << 20, tensor_parallel_size=1, dtype="half"))
    cfg = args.create_engine_config()
    assert (cfg.model_config.revision, cfg.model_config.max_logprobs, cfg.model_config.dtype) == ("main", 3, "float16")
    assert cfg.cache_config.kv_cache_memory_bytes == 1 << 20


def test_vllm_arguments_at_jaxlm_behaviour_are_accepted():
    args = _engine_args(None, dict(tokenizer_mode="auto", quantization=None, enable_chunked_prefill=True,
                                   seed=3))
    assert args.seed == 3


@pytest.mark.parametrize("kwargs,error,needle", [
    ({"enable_chunked_prefill": False}, ValueError, "always chunks prefills"),
    ({"no_such_arg": 1}, TypeError, "Unknown engine argument(s): no_such_arg"),
])
def test_unsupported_arguments_are_refused_clearly(kwargs, error, needle):
    with pytest.raises(error) as err:
        _engine_args(None, kwargs)
    assert needle in str(err.value)


def test_quantization_is_an_engine_field():
    cfg = _engine_args("m", dict(quantization="fp8")).create_engine_config()
    assert cfg.model_config.quantization == "fp8"
    with pytest.raises(ValueError, match="Unknown quantization 'bitsandbytes'; supported: fp8, awq, gptq"):
        _engine_args("m", dict(quantization="bitsandbytes")).create_engine_config()


def test_enforce_eager_refused_before_loading():
    from jaxlm import LLM

    with pytest.raises(ValueError, match="enforce_eager=True is not supported"):
        LLM(model="/nonexistent", enforce_eager=True)
