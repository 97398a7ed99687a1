"""EngineArgs and the CLI flags come from the config dataclasses; vLLM's spellings parse."""

from __future__ import annotations

import dataclasses

import pytest

from jaxlm import config as c
from jaxlm.config import human_readable_int, parse_bytes
from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.serve.cli_args import SERVER_DEFAULTS, make_arg_parser


@pytest.mark.parametrize("text,value", [("2048", 2048), ("32k", 32000), ("32K", 32768), ("1m", 10**6),
                                        ("1M", 2**20), ("25.6k", 25600)])
def test_human_readable_int(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["3.5K", "32x", "", "k"])
def test_human_readable_int_refuses(text):
    with pytest.raises(ValueError):
        human_readable_int(text)


@pytest.mark.parametrize("text,value", [("4000000000", 4 * 10**9), ("1e9", 10**9), ("4GiB", 4 << 30),
                                        ("4G", 4 << 30), ("4GB", 4 * 10**9), ("4g", 4 * 10**9),
                                        ("512MiB", 512 << 20), ("1.5GiB", 3 << 29)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["four", "1.5", "4GX", "-1"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def _parse(*argv: str):
    return make_arg_parser().parse_args(list(argv))


def _config(*argv: str) -> c.EngineConfig:
    return EngineArgs.from_cli_args(_parse(*argv)).create_engine_config()


def test_every_config_argument_is_an_engine_arg_and_a_flag_with_the_same_default():
    defaults = _parse()
    engine_args = EngineArgs()
    for config_cls in c.ARG_CONFIGS:
        for f in c.arg_fields(config_cls):
            assert getattr(engine_args, f.name) == f.default, f.name
            assert getattr(defaults, f.name) == SERVER_DEFAULTS.get(f.name, f.default), f.name
    assert {f.name for f in dataclasses.fields(EngineArgs)} == {
        f.name for cls in c.ARG_CONFIGS for f in c.arg_fields(cls)}


def test_the_server_defers_program_loads_and_compiles_and_llm_does_not():
    # The engine arguments whose server default differs (SERVER_DEFAULTS), and their --no- forms.
    assert SERVER_DEFAULTS == {"defer_program_load": True, "compile_in_background": True}
    for name in SERVER_DEFAULTS:
        flag = "--no-" + name.replace("_", "-")
        assert getattr(_config().compilation_config, name) is True
        assert getattr(_config(flag).compilation_config, name) is False
        assert getattr(EngineArgs().create_engine_config().compilation_config, name) is False


def test_default_engine_config_is_the_default_configs():
    cfg = EngineArgs().create_engine_config()
    assert cfg.model_config == c.ModelConfig()
    assert cfg.cache_config == c.CacheConfig()
    assert cfg.scheduler_config == c.SchedulerConfig()
    assert cfg.parallel_config == c.ParallelConfig()
    assert cfg.compilation_config == c.CompilationConfig()
    assert cfg.observability_config == c.ObservabilityConfig()


def test_max_model_len_is_declared_once_and_copied_to_the_scheduler():
    assert "max_model_len" not in {f.name for f in c.arg_fields(c.SchedulerConfig)}
    cfg = _config("--max-model-len", "4k")
    assert cfg.model_config.max_model_len == cfg.scheduler_config.max_model_len == 4000
    assert EngineArgs().create_engine_config().scheduler_config.max_model_len is None  # engine resolves


def test_vllm_spellings():
    cfg = _config("--dtype", "half", "--kv-cache-memory-bytes", "4GiB", "-tp", "1", "-pp", "1", "-dp", "1",
                  "--max-logprobs", "5", "--chat-template", "{{ messages }}", "--generation-config", "vllm",
                  "--override-generation-config", '{"temperature": 0.5}', "--disable-log-stats",
                  "--enable-log-requests", "--token-buckets", "16,32", "--served-model-name", "a", "b",
                  "--max-num-batched-tokens", "1K", "--trust-remote-code")
    mc = cfg.model_config
    assert (mc.dtype, mc.max_logprobs, mc.generation_config) == ("float16", 5, "vllm")
    assert mc.chat_template == "{{ messages }}"
    assert mc.override_generation_config == {"temperature": 0.5} and mc.served_model_name == ["a", "b"]
    assert mc.trust_remote_code is True
    assert cfg.cache_config.kv_cache_memory_bytes == 4 << 30
    assert cfg.scheduler_config.max_num_batched_tokens == 1024
    assert cfg.compilation_config.token_buckets == [16, 32]
    assert cfg.observability_config.disable_log_stats and cfg.observability_config.enable_log_requests
    assert _config("--dtype", "float").model_config.dtype == "float32"
    assert _config("--kv-cache-memory", "1e9").cache_config.kv_cache_memory_bytes == 10**9  # old spelling
    assert _config("--tensor-parallel-size", "2").parallel_config.tensor_parallel_size == 2


def test_chat_template_from_a_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _config("--chat-template", str(path)).model_config.chat_template == path.read_text()


@pytest.mark.parametrize("argv,needle", [
    (["--dtype", "float64"], "invalid choice: 'float64'"),
    (["--max-model-len", "3.5K"], "no decimals with binary suffixes"),
    (["--kv-cache-memory-bytes", "lots"], "is not a byte count"),
    (["--allowed-origins", "*"], "is not a JSON list"),
    (["--override-generation-config", "[1]"], "expected a JSON object"),
    (["--attention-backend", "cuda"], "invalid choice: 'cuda'"),
    (["tiny", "--model", "other"], "the model is given twice"),
])
def test_bad_flags_are_refused_naming_the_problem(argv, needle, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert needle in capsys.readouterr().err


def test_chat_template_missing_file_is_refused():
    with pytest.raises(ValueError, match="looks like a path, but no such file exists"):
        _config("--chat-template", "templates/none.jinja")


def test_enforce_eager_refused_clearly():
    with pytest.raises(ValueError, match="enforce_eager=True is not supported"):
        _config("--enforce-eager")


def test_help_shows_defaults_and_choices(capsys):
    with pytest.raises(SystemExit):
        _parse("--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "most requests running in one step (default: 64)" in out
    assert "--dtype {auto,float32,bfloat16,float16,half,float}" in out
    assert "--attention-backend {auto,xla,pallas,cpu}" in out
    assert "--kv-cache-memory-bytes KV_CACHE_MEMORY_BYTES, --kv-cache-memory KV_CACHE_MEMORY_BYTES" in out
    assert "-tp TENSOR_PARALLEL_SIZE" in out and "-pp PIPELINE_PARALLEL_SIZE" in out
    for group in ("ModelConfig:", "CacheConfig:", "SchedulerConfig:", "ParallelConfig:", "CompilationConfig:"):
        assert group in out
    assert "(default: None) (default" not in out  # no second default in help that names its own


def test_positional_model_and_server_flags(monkeypatch):
    monkeypatch.delenv("JAXLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = _parse("org/tiny", "--api-key", "a", "b", "--api-key", "c", "--allowed-origins", '["http://x"]',
                  "--allowed-methods", '["GET"]', "--allowed-headers", '["X-A"]', "--root-path", "/llm",
                  "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem")
    assert args.model == "org/tiny" and args.api_key == ["a", "b", "c"]
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers) == (["http://x"], ["GET"], ["X-A"])
    assert (args.root_path, args.ssl_keyfile, args.ssl_certfile) == ("/llm", "k.pem", "c.pem")
    assert _parse("m", "--model", "m").model == "m"
    none = _parse()
    assert none.api_key is None and none.allowed_origins == ["*"]
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert _parse().api_key == ["env-key"]
    assert _parse("--api-key", "x").api_key == ["x"]


def test_compilation_cache_dir_under_the_one_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLM_CACHE_DIR", str(tmp_path))
    assert c.CompilationConfig().resolved_cache_dir() == str(tmp_path / "xla")
    assert c.CompilationConfig(compilation_cache_dir="").resolved_cache_dir() is None
    monkeypatch.setenv("JAXLM_CACHE_DIR", "")
    assert c.jaxlm_cache_root() is None and c.CompilationConfig().resolved_cache_dir() is None
    monkeypatch.delenv("JAXLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert c.jaxlm_cache_root() == str(tmp_path / "xdg" / "jaxlm")


def test_enable_expert_parallel_flag(caplog):
    assert _config("-tp", "4", "--enable-expert-parallel").parallel_config.enable_expert_parallel is True
    assert _config().parallel_config.enable_expert_parallel is False
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        c.ParallelConfig(enable_expert_parallel="yes")
    with caplog.at_level("WARNING"):  # EP does not span -dp cores: said, not silently ignored
        c.ParallelConfig(enable_expert_parallel=True, data_parallel_size=2)
    assert "not across the 2 -dp cores" in caplog.text
