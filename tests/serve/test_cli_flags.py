"""Every flag of `python -m jaxlm.serve --help` changes what the server or the engine does, and
one test shows it: FLAG_TESTS names that test for each flag (a new flag without one fails
here). The flags no other module covered are tested below, on the fake engine where the flag is
the server's alone."""

from __future__ import annotations

import ast
import os
import threading
import time

import httpx
import pytest

from jaxlm.serve.cli_args import make_arg_parser

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# flag -> "tests/<file>::<test function>" showing its effect.
FLAG_TESTS = {
    # server
    "MODEL": "tests/serve/test_engine_core_proc.py::test_dp2_engine_labels_idle_gauges_and_log_flags",
    "--host": "tests/serve/test_cli.py::test_serve_tiny_model_then_sigterm_drains_and_exits_0",
    "--port": "tests/serve/test_cli.py::test_serve_tiny_model_then_sigterm_drains_and_exits_0",
    "--api-key": "tests/serve/test_hostile_config.py::test_api_key_guards_all_but_probes_and_guard_probes_guards_those",
    "--guard-probes": "tests/serve/test_hostile_config.py::test_api_key_guards_all_but_probes_and_guard_probes_guards_those",
    "--allowed-origins": "tests/serve/test_hostile_config.py::test_cors_and_root_path",
    "--allowed-methods": "tests/serve/test_cli_flags.py::test_cors_methods_headers_and_credentials",
    "--allowed-headers": "tests/serve/test_cli_flags.py::test_cors_methods_headers_and_credentials",
    "--allow-credentials": "tests/serve/test_cli_flags.py::test_cors_methods_headers_and_credentials",
    "--root-path": "tests/serve/test_hostile_config.py::test_cors_and_root_path",
    "--ssl-keyfile": "tests/serve/test_hostile_config.py::test_tls_from_ssl_flags",
    "--ssl-certfile": "tests/serve/test_hostile_config.py::test_tls_from_ssl_flags",
    "--trust-request-chat-template": "tests/serve/test_hostile_config.py::test_trusted_request_template_renders_like_the_models_own",
    "--chat-template-timeout": "tests/serve/test_hostile_config.py::test_a_looping_request_template_fails_that_request_only",
    "--max-request-body-bytes": "tests/serve/test_hostile_config.py::test_body_limit_and_prompt_cap",
    "--request-header-timeout": "tests/serve/test_hostile.py::test_slow_headers_are_cut_off",
    "--max-prompts-per-request": "tests/serve/test_hostile_config.py::test_body_limit_and_prompt_cap",
    "--shutdown-timeout": "tests/serve/test_cli_flags.py::test_shutdown_timeout_cuts_streams_that_outlive_it",
    # Default (info, access log on): test_cli; --uvicorn-log-level warning: test_hostile's server.
    "--uvicorn-log-level": "tests/serve/test_hostile.py::test_probes_are_open_and_version_is_the_package_version",
    "--disable-uvicorn-access-log": "tests/serve/test_engine_core_proc.py::test_dp2_engine_labels_idle_gauges_and_log_flags",
    "--enable-tokenizer-info-endpoint": "tests/serve/test_compat.py::test_tokenizer_info_is_opt_in",
    "--enable-auto-tool-choice": "tests/serve/test_structured_server.py::test_auto_tool_choice_needs_the_server_flags",
    "--tool-call-parser": "tests/serve/test_structured_server.py::test_auto_tool_choice_needs_the_server_flags",
    "--reasoning-parser": "tests/serve/test_structured_server.py::test_reasoning_parser_splits_whole_and_streamed",
    # ModelConfig
    "--model": "tests/serve/test_cli.py::test_serve_tiny_model_then_sigterm_drains_and_exits_0",
    "--tokenizer": "tests/model_loader/test_loader_resolve.py::test_tokenizer_from_directory",
    "--revision": "tests/model_loader/test_loader_hf_cache.py::test_explicit_revision",
    "--skip-tokenizer-init": "tests/serve/test_serving_priority_dp.py::test_text_needs_a_tokenizer",
    # Accepted for vLLM scripts; jaxlm never runs a model's code (the test: accepted, no effect).
    "--trust-remote-code": "tests/entrypoints/test_llm_args.py::test_engine_fields_are_accepted",
    "--dtype": "tests/model_loader/test_loader_safetensors.py::test_bf16_checkpoint_and_dtype_placement",
    "--quantization": "tests/model_loader/test_gguf_blocks.py::test_llm_quantization_flag",
    "--max-model-len": "tests/entrypoints/test_llm_api.py::test_bad_request_fails_alone",
    "--quantization": "tests/models/quantization/test_quantized_engine.py::test_online_fp8_through_llm",
    "--seed": "tests/entrypoints/test_sampling_e2e.py::test_unseeded_requests_differ_but_engine_seed_repeats",
    "--served-model-name": "tests/serve/test_real_engine.py::test_errors_on_real_engine",
    "--generation-config": "tests/entrypoints/test_generation_config.py::test_generation_config_modes",
    "--override-generation-config": "tests/serve/test_compat.py::test_default_sampling_comes_from_the_generation_config",
    "--max-logprobs": "tests/serve/test_hostile.py::test_hostile_cases_get_clean_4xx_and_leave_the_server_healthy",
    "--limit-mm-per-prompt": "tests/models/test_llava.py::test_limits_and_placeholder_count_are_checked",
    "--mm-processor-kwargs": "tests/serve/test_qwen2_5_vl_server.py::test_data_and_http_url_images_match_transformers",
    "--allowed-local-media-path": "tests/serve/test_llava_server.py::test_http_and_file_urls_give_the_data_url_text",
    "--chat-template": "tests/serve/test_inproc_server.py::test_chat_template_flag_renders_chat_tokenize_tools_and_reasoning",
    "--enforce-eager": "tests/engine/test_arg_utils.py::test_enforce_eager_refused_clearly",
    # LoadConfig
    "--load-format": "tests/model_loader/test_loader_orbax.py::test_round_trip_identical",
    # CacheConfig
    "--block-size": "tests/core/test_kv_cache_manager.py::test_allocate_counts_blocks_and_fails_without_side_effects",
    "--gpu-memory-utilization": "tests/worker/test_worker.py::test_kv_cache_budget_flags",
    "--kv-cache-memory-bytes": "tests/worker/test_worker.py::test_kv_cache_budget_flags",
    "--num-gpu-blocks-override": "tests/serve/test_engine_core_proc.py::test_dp2_engine_labels_idle_gauges_and_log_flags",
    "--enable-prefix-caching": "tests/entrypoints/test_llm_api.py::test_n_siblings_share_prompt_blocks",
    "--kv-cache-dtype": "tests/serve/test_kv_cache_dtype_server.py::test_fp8_server_holds_4x_the_blocks_and_says_so",
    "--calculate-kv-scales": "tests/entrypoints/test_kv_cache_dtype.py::test_calculate_kv_scales_from_the_first_batch",
    # SchedulerConfig
    "--max-num-seqs": "tests/core/test_scheduler.py::test_max_num_seqs_caps_running",
    "--max-num-batched-tokens": "tests/serve/test_compat.py::test_echo_logprobs_keep_every_prompt_position_over_a_multi_step_prefill",
    "--max-num-queued-reqs": "tests/serve/test_hostile.py::test_hostile_cases_get_clean_4xx_and_leave_the_server_healthy",
    "--async-scheduling": "tests/engine/test_async_scheduling.py::test_driver_is_used_only_when_asked",
    "--scheduling-policy": "tests/serve/test_serving_priority_dp.py::test_priority_orders_each_core_across_the_process_boundary",
    # ParallelConfig
    "--tensor-parallel-size": "tests/executor/test_mesh_executor.py::test_each_device_holds_only_its_shard",
    "--pipeline-parallel-size": "tests/executor/test_pipeline_parallel.py::test_each_stage_holds_only_its_layers",
    "--data-parallel-size": "tests/serve/test_engine_core_proc.py::test_dp2_engine_labels_idle_gauges_and_log_flags",
    "--enable-expert-parallel": "tests/models/test_moe_parallel.py::test_each_device_holds_its_experts",
    "--nnodes": "tests/executor/test_multihost_executor.py::test_two_processes_give_the_tokens_of_one",
    "--node-rank": "tests/executor/test_multihost_executor.py::test_two_processes_give_the_tokens_of_one",
    "--master-addr": "tests/executor/test_executor.py::test_master_addr_and_port_are_the_coordinator",
    "--master-port": "tests/executor/test_executor.py::test_master_addr_and_port_are_the_coordinator",
    "--headless": "tests/executor/test_multihost_executor.py::test_two_processes_give_the_tokens_of_one",
    "--distributed-timeout-seconds": "tests/executor/test_multihost_executor.py::test_killed_follower_kills_the_engine",
    # CompilationConfig
    "--token-buckets": "tests/worker/test_model_runner.py::test_program_count_is_a_sum",
    "--seq-buckets": "tests/worker/test_model_runner.py::test_program_count_is_a_sum",
    "--workload": "tests/engine/test_auto_buckets.py::test_llm_with_auto_buckets",
    "--max-programs": "tests/engine/test_auto_buckets.py::test_llm_with_auto_buckets",
    "--compilation-cache-dir": "tests/executor/test_executor.py::test_configure_compilation_cache_once",
    "--defer-program-load": "tests/serve/test_deferred_programs.py::test_no_defer_program_load_loads_all_before_serving",
    "--compile-in-background": "tests/serve/test_deferred_programs.py::test_a_cold_server_serves_while_it_compiles_the_rest",
    "--compilation-config": "tests/entrypoints/test_llm_args.py::test_compilation_config_cudagraph_mode_through_llm_and_the_server_flags",
    # ObservabilityConfig
    "--disable-log-stats": "tests/serve/test_engine_core_proc.py::test_dp2_engine_labels_idle_gauges_and_log_flags",
    "--enable-log-requests": "tests/serve/test_inproc_server.py::test_enable_log_requests_logs_arrivals_cut_to_max_log_len_and_aborts",
    "--max-log-len": "tests/serve/test_inproc_server.py::test_enable_log_requests_logs_arrivals_cut_to_max_log_len_and_aborts",
    # LoRAConfig and the server's adapters
    "--enable-lora": "tests/serve/test_lora_server.py::test_load_needs_enable_lora",
    "--max-loras": "tests/lora/test_lora_llm.py::test_mixed_adapters_match_peft",
    "--max-lora-rank": "tests/serve/test_lora_server.py::test_bad_adapters_are_400s_that_change_nothing",
    "--max-cpu-loras": "tests/lora/test_lora_llm.py::test_mixed_adapters_match_peft",
    "--lora-modules": "tests/serve/test_lora_server.py::test_models_list_adapters_with_parent",
    # EngineConfig
    "--runner": "tests/entrypoints/test_llm_embed.py::test_runner_convert_and_task_flags",
    "--convert": "tests/entrypoints/test_llm_embed.py::test_runner_convert_and_task_flags",
    "--task": "tests/entrypoints/test_llm_embed.py::test_runner_convert_and_task_flags",
    "--pooler-config": "tests/entrypoints/test_llm_embed.py::test_all_pooling_returns_every_tokens_hidden_state",
    "--attention-backend": "tests/attention/test_backend_e2e.py::test_pallas_equals_xla_and_decode_steps_run_the_decode_kernel",
    "--speculative-config": "tests/spec_decode/test_spec_server.py::test_completions_and_metrics",
}


def _help_flags() -> set[str]:
    """Each option of --help by its first long name (a --no-X twin is the same option)."""
    flags = set()
    for action in make_arg_parser()._actions:
        if not action.option_strings:
            flags.add(action.metavar or action.dest)
        elif "--help" not in action.option_strings:
            flags.add(next(o for o in action.option_strings if o.startswith("--")))
    return flags


def _test_functions(path: str) -> set[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_help_flag_has_a_behaviour_test():
    flags = _help_flags()
    assert not flags - FLAG_TESTS.keys(), f"flags without a behaviour test: {sorted(flags - FLAG_TESTS.keys())}"
    assert not FLAG_TESTS.keys() - flags, f"tests listed for flags --help lacks: {sorted(FLAG_TESTS.keys() - flags)}"
    for flag, test in FLAG_TESTS.items():
        path, _, name = test.partition("::")
        assert name in _test_functions(path), f"{flag}: {test} does not exist"


def test_cors_methods_headers_and_credentials(fake_server_factory):
    preflight = {"origin": "https://app.example", "access-control-request-method": "DELETE",
                 "access-control-request-headers": "x-trace"}
    default = fake_server_factory().http().options("/v1/models", headers=preflight)
    assert default.status_code == 200 and "access-control-allow-credentials" not in default.headers
    srv = fake_server_factory(["--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["x-ok"]',
                               "--allow-credentials", "--allowed-origins", '["https://app.example"]'])
    http = srv.http()
    refused = http.options("/v1/models", headers=preflight)
    assert refused.status_code == 400 and "method" in refused.text and "headers" in refused.text
    ok = http.options("/v1/models", headers={**preflight, "access-control-request-method": "POST",
                                             "access-control-request-headers": "x-ok"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-credentials"] == "true"
    assert set(ok.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}


def test_shutdown_timeout_cuts_streams_that_outlive_it(fake_server_factory):
    """A stream of ~3 s (the fake engine's 10 ms steps) under --shutdown-timeout 1 is cut when the
    server stops; with the default (30 s) such a stream finishes (test_cli.py)."""
    srv = fake_server_factory(["--shutdown-timeout", "1"], step_delay=0.01)
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "Hello", "max_tokens": 300, "stream": True, "ignore_eos": True}
        try:
            with httpx.Client(base_url=srv.base, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        lines.append(line)
                        started.set()
        except httpx.HTTPError as e:
            lines.append(f"cut: {type(e).__name__}")
        started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    begin = time.monotonic()
    srv.stop()
    reader.join(30)
    took = time.monotonic() - begin
    assert 0.9 < took < 5, took
    assert not any('"finish_reason":"length"' in line for line in lines), lines[-3:]
