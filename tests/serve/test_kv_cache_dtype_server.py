"""`python -m jaxlm.serve --kv-cache-dtype fp8`: the same --kv-cache-memory-bytes holds 4x the
float32 cache's blocks, the start-up log says how many tokens fit, /metrics' cache_config_info
says the dtype and the blocks, and the server answers."""

from __future__ import annotations

import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve import server_process
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.timeout(400)

# The tiny Llama's float32 block: K+V x 2 layers x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
F32_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
F32_BLOCKS = 40


def test_fp8_server_holds_4x_the_blocks_and_says_so(tiny_llama, monkeypatch):
    # Sized from the memory flag, not the shared flags' block override.
    flags = list(server_process.TINY_ENGINE_FLAGS)
    i = flags.index("--num-gpu-blocks-override")
    monkeypatch.setattr(server_process, "TINY_ENGINE_FLAGS", flags[:i] + flags[i + 2:])
    srv = ServerProcess(tiny_llama, ["--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes",
                                     str(F32_BLOCKS * F32_BLOCK_BYTES)])
    try:
        families = {f.name: f for f in text_string_to_metric_families(srv.metrics_text())}
        [info] = families["vllm:cache_config_info"].samples
        assert info.labels["cache_dtype"] == "fp8"
        assert info.labels["num_gpu_blocks"] == str(4 * F32_BLOCKS)
        out = srv.client().completions.create(model=tiny_llama, prompt="Hello", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
        assert f"KV cache (fp8, float8_e4m3fn): {4 * F32_BLOCKS * 16} tokens fit" in srv.output()
    finally:
        srv.stop(signal.SIGKILL)
