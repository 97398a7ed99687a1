"""A server's warm start through `python -m jaxlm.serve`: by default (defer_program_load) it
answers /health once the program cache's file is read, loads each program on first use or
while idle, and answers what a server that loaded every program first answers;
--no-defer-program-load loads them all before serving. Three starts on one cache directory."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.serve.server_process import ServerProcess
from tests.helpers.tiny_models import make_tiny_engine_model

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]


def _answers(server: ServerProcess) -> list[tuple[str, list[float]]]:
    client = server.client()
    out = []
    for prompt in PROMPTS:
        c = client.completions.create(model=server.model_path, prompt=prompt, max_tokens=8, temperature=0,
                                      logprobs=2).choices[0]
        out.append((c.text, c.logprobs.token_logprobs))
    return out


def _wait_for_line(server: ServerProcess, needle: str, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in server.output():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deferred")
    model = make_tiny_engine_model("llama", tmp / "tiny")
    flags = ["--compilation-cache-dir", str(tmp / "xla")]
    # One device, as the program cache requires (other test modules widen XLA_FLAGS to 8 host devices).
    env = {"XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)}
    results = {}
    for name, extra in (("cold", []), ("deferred", []), ("eager", ["--no-defer-program-load"])):
        server = ServerProcess(model, flags + extra, env=env)
        try:
            answers = _answers(server)
            if name == "deferred":
                assert _wait_for_line(server, "all deferred programs loaded"), server.log_tail()
                answers += _answers(server)  # every program loaded now: the same again
            results[name] = (answers, server.output())
        finally:
            server.stop()
    return results


def _from_cache(log: str) -> re.Match:
    m = re.search(r"Compiled (\d+) programs in [\d.]+ s \((\d+) from the program cache(, loaded on use)?\)", log)
    assert m, log[-3000:]
    return m


def test_the_cold_start_compiles_every_program(starts):
    m = _from_cache(starts["cold"][1])
    assert int(m[1]) > 1 and m[2] == "0" and m[3] is None


def test_a_warm_server_defers_its_programs_and_answers_the_same(starts):
    (cold, _), (deferred, log) = starts["cold"], starts["deferred"]
    m = _from_cache(log)
    assert m[1] == m[2] == _from_cache(starts["cold"][1])[1] and m[3] == ", loaded on use"
    assert deferred == cold + cold  # text and logprobs, while loading and once all are loaded


def test_no_defer_program_load_loads_all_before_serving(starts):
    (cold, _), (eager, log) = starts["cold"], starts["eager"]
    m = _from_cache(log)
    assert m[1] == m[2] and m[3] is None and "all deferred programs loaded" not in log
    assert eager == cold
