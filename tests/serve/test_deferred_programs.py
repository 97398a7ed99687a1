"""A server's start through `python -m jaxlm.serve`, three on one cache directory. Cold, by
default (compile_in_background) it compiles the largest buckets' programs, answers, and compiles
the rest while it serves, then writes the program cache. Warm, by default (defer_program_load)
it answers /health once that file is read, loads each program on first use or while idle, and
answers what a server that loaded every program first answers; --no-defer-program-load loads
them all before serving."""

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
    # Four token buckets and two sequence buckets: 10 of the 18 programs compile in the background.
    flags = ["--compilation-cache-dir", str(tmp / "xla"), "--token-buckets", "1,4,16,64", "--seq-buckets", "1,8"]
    # One device, as the program cache requires (other test modules widen XLA_FLAGS to 8 host devices).
    env = {"XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)}
    results = {}
    for name, extra in (("cold", []), ("deferred", []), ("eager", ["--no-defer-program-load"])):
        server = ServerProcess(model, flags + extra, env=env)
        try:
            answers = _answers(server)
            if name == "cold":
                results["cold_answered_while_compiling"] = "programs compiled (" not in server.output()
                assert _wait_for_line(server, "programs compiled ("), server.log_tail()
                answers += _answers(server)  # every program compiled (and the file written) now
            if name == "deferred":
                assert _wait_for_line(server, "all deferred programs loaded"), server.log_tail()
                answers += _answers(server)  # every program loaded now: the same again
            results[name] = (answers, server.output())
        finally:
            server.stop()
    return results


def _from_cache(log: str) -> re.Match:
    m = re.search(r"Compiled (\d+) programs in [\d.]+ s \((\d+) from the program cache(, loaded on use)?"
                  r"(; (\d+) more compile in the background while serving)?\)", log)
    assert m, log[-3000:]
    return m


def _same(got: list, want: list) -> None:
    # A step padded to another bucket may round the logprobs differently in the last bits.
    assert [text for text, _ in got] == [text for text, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_cold_server_serves_while_it_compiles_the_rest(starts):
    cold, log = starts["cold"]
    m = _from_cache(log)
    now, later = int(m[1]), int(m[5] or 0)
    assert m[2] == "0" and m[3] is None and now > 1 and later > 1
    assert re.search(rf"all {now + later} programs compiled \({later} in the background", log), log[-3000:]
    assert starts["cold_answered_while_compiling"]
    _same(cold[:2], cold[2:])  # while compiling, on the largest buckets, and after


def test_a_warm_server_defers_its_programs_and_answers_the_same(starts):
    (cold, cold_log), (deferred, log) = starts["cold"], starts["deferred"]
    m, c = _from_cache(log), _from_cache(cold_log)
    assert int(m[1]) == int(m[2]) == int(c[1]) + int(c[5] or 0) and m[3] == ", loaded on use"
    assert deferred[:2] == deferred[2:]  # while loading and once all are loaded
    _same(deferred, cold)


def test_no_defer_program_load_loads_all_before_serving(starts):
    (cold, _), (eager, log) = starts["cold"], starts["eager"]
    m = _from_cache(log)
    assert m[1] == m[2] and m[3] is None and "all deferred programs loaded" not in log
    assert eager == starts["deferred"][0][:2]
    _same(eager, cold[2:])
