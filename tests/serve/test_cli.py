"""`python -m jaxlm.serve` as a real process: --help, serving a tiny model, SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_lists_server_and_engine_flags():
    out = subprocess.run([sys.executable, "-m", "jaxlm.serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--gpu-memory-utilization", "--tensor-parallel-size", "--max-num-queued-reqs", "--seed",
                 "--attention-backend", "--dtype"):
        assert flag in out.stdout, flag
    # Each config's group shows its flags with their defaults.
    text = " ".join(out.stdout.split())
    model_group, scheduler_group = text.index("ModelConfig:"), text.index("SchedulerConfig:")
    assert model_group < text.index("--skip-tokenizer-init, --no-skip-tokenizer-init load no tokenizer") < scheduler_group
    assert "are refused (default: False)" in text
    assert scheduler_group < text.index("--scheduling-policy {fcfs,priority} waiting-queue order")
    assert "preemption takes the worst) (default: fcfs)" in text


def test_serve_tiny_model_then_sigterm_drains_and_exits_0(tmp_path, tiny_llama):
    """Also the defaults of the server's own flags: uvicorn logs at info with its access log;
    --host binds that address only (127.0.0.2: loopback, but not 127.0.0.1)."""
    path = tiny_llama
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxlm.serve", "--model", path, "--host", "127.0.0.2", "--port", str(port),
           "--served-model-name", "tiny",
           "--api-key", "k", "--max-model-len", "128", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
           "--num-gpu-blocks-override", "160", "--token-buckets", "16,64", "--seq-buckets", "16"]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())
    try:
        base = f"http://127.0.0.2:{port}"
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens <= 4 and out.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(httpx.ConnectError):  # --host 127.0.0.2: nothing listens on 127.0.0.1
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        logged = (tmp_path / "server.log").read_text()
        assert "Application startup complete" in logged and '"POST /v1/completions HTTP/1.1" 200' in logged
        # SIGTERM while a stream is in flight: it finishes, the process exits 0.
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=100, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
