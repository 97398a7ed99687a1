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


def test_compilation_config_cudagraph_mode_through_llm_and_the_server_flags(capsys):
    """vLLM's compilation_config (LLM(compilation_config=...), -O / --compilation-config):
    cudagraph_mode lands in CompilationConfig and in the program cache's key; bad values are
    refused naming the field and its choices, before anything loads."""
    from jaxlm import LLM
    from jaxlm.engine.arg_utils import EngineArgs
    from jaxlm.serve.__main__ import main
    from jaxlm.serve.cli_args import make_arg_parser
    from jaxlm.worker.program_cache import program_key

    def mode(**kw):
        return _engine_args("m", kw).create_engine_config().compilation_config.cudagraph_mode

    assert mode(compilation_config={"cudagraph_mode": "full_decode_only"}) == "FULL_DECODE_ONLY"
    assert (mode(compilation_config=0), mode(compilation_config=3), mode()) == ("NONE", None, None)
    for argv, want in ((["-O", '{"cudagraph_mode": "PIECEWISE"}'], "PIECEWISE"),
                       (["--compilation-config", '{"cudagraph_mode": "FULL"}'], "FULL"), (["-O0"], "NONE")):
        args = EngineArgs.from_cli_args(make_arg_parser().parse_args(["m", *argv]))
        assert args.create_engine_config().compilation_config.cudagraph_mode == want
    with pytest.raises(ValueError, match="cudagraph_mode must be one of NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, "
                                         "FULL_AND_PIECEWISE, got 'FULLL'"):
        LLM(model="/nonexistent", compilation_config={"cudagraph_mode": "FULLL"})
    with pytest.raises(ValueError, match="unknown key.*'cudagraph_capture_sizes'.*--token-buckets"):
        LLM(model="/nonexistent", compilation_config={"cudagraph_capture_sizes": [1, 2]})
    with pytest.raises(SystemExit) as exit_:
        main(["m", "-O", '{"cudagraph_mode": "FULLL"}'])
    assert exit_.value.code == 2 and "cudagraph_mode must be one of" in capsys.readouterr().err
    configs = [_engine_args("m", {"compilation_config": {"cudagraph_mode": m}}).create_engine_config()
               for m in ("FULL", "FULL", "NONE")]
    keys = [program_key(c, [], [], []) for c in configs]
    assert keys[0] == keys[1] != keys[2]
