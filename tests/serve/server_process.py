"""A real `python -m jaxlm.serve` process on a tiny model, for the tests that need the whole
server (hostile clients, the dead-engine exit). Optionally started through a test-only patch
module (tests/serve/fault_patch.py), which the production entry point knows nothing about."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from typing import Any

import httpx
import openai

from jaxlm.serve.metrics import parse_metrics

REPO = Path(__file__).resolve().parents[2]
TINY_ENGINE_FLAGS = ["--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                     "--num-gpu-blocks-override", "160", "--token-buckets", "16,64", "--seq-buckets", "8",
                     "--seed", "0", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, flags: list[str], *, fault_patch: bool = False, port: int | None = None,
                 env: dict[str, str] | None = None, wait: bool = True) -> None:
        self.model_path = model
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        if fault_patch:  # the test's own wrapper: patches first, then runs the real entry point
            launcher = ["-c", "import fault_patch, runpy; runpy.run_module('jaxlm.serve', run_name='__main__')"]
        else:
            launcher = ["-m", "jaxlm.serve"]
        # A file, not a pipe: a full pipe would block the server's logging, and so the server.
        self._log = tempfile.TemporaryFile("w+", encoding="utf-8")
        pythonpath = os.pathsep.join([str(REPO), str(REPO / "tests" / "serve"), os.environ.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, model, "--port", str(self.port), *TINY_ENGINE_FLAGS, *flags],
            env={**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", **(env or {})},
            stdout=self._log, stderr=subprocess.STDOUT, text=True)
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout} s")

    def output(self) -> str:
        """Everything the process printed so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def log_tail(self) -> str:
        return self.output()[-4000:]

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="EMPTY", max_retries=0, timeout=120, **kw)

    def metrics_text(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=10).text

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
