"""A server whose first start was cut short still gets a program cache (worker/program_cache.py).
Three `python -m jaxlm.serve` starts on one cache directory: the first is stopped right after
/health, before its background compiles end, so JAX's cache holds some programs and no program
cache file exists; the second gets those from JAX's cache (XLA:CPU cannot serialize them again),
compiles them again in the background and writes the file; the third loads every program from it.
The test counts programs in the log lines; it times nothing."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest

from tests.helpers.tiny_models import make_tiny_engine_model
from tests.serve.server_process import ServerProcess

COMPILED = re.compile(r"Compiled (\d+) programs in [\d.]+ s \((\d+) from the program cache(, loaded on use)?"
                      r"(; (\d+) more compile in the background while serving)?\)")


def _wait_for_line(server: ServerProcess, pattern: str, timeout: float = 600.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := re.search(pattern, server.output()):
            return m
        assert server.proc.poll() is None, server.log_tail()
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in:\n{server.log_tail()}")


def _answer(server: ServerProcess) -> str:
    return server.client().completions.create(model=server.model_path, prompt="1, 2, 3,", max_tokens=6,
                                              temperature=0).choices[0].text


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    model = make_tiny_engine_model("llama", tmp / "tiny")
    # One token bucket, two sequence buckets: 8 programs before /health, 6 samplers in the background.
    flags = ["--compilation-cache-dir", str(tmp / "xla"), "--token-buckets", "64", "--seq-buckets", "2,8"]
    # One device, as the program cache requires (other test modules widen XLA_FLAGS to 8 host devices).
    env = {"XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)}
    files = lambda: glob.glob(str(tmp / "xla" / "jaxlm-programs" / "*.pkl"))  # noqa: E731
    logs, answers = {}, {}

    first = ServerProcess(model, flags, env=env)
    first.stop()
    logs["first"] = first.output()
    # A fast machine may finish the background compiles before the stop: the file it wrote is
    # removed, so the second start always finds JAX's cache without a program cache.
    for f in files():
        os.unlink(f)

    second = ServerProcess(model, flags, env=env)
    try:
        answers["second"] = _answer(second)
        _wait_for_line(second, r"all \d+ programs compiled \(")  # logged after the program cache's save()
        answers["second_after"] = _answer(second)
    finally:
        second.stop()
    logs["second"] = second.output()
    written = files()

    third = ServerProcess(model, flags, env=env)
    try:
        answers["third"] = _answer(third)
    finally:
        third.stop()
    logs["third"] = third.output()
    return logs, answers, written


def test_the_second_start_compiles_again_what_came_from_jax_cache(starts):
    logs, _, written = starts
    log = logs["second"]
    m = COMPILED.search(log)
    assert m and m[2] == "0", log[-3000:]
    now, later = int(m[1]), int(m[5] or 0)
    # The programs compiled before the first server's /health came from JAX's cache this time.
    hits = re.search(r"(\d+) programs came from JAX's compilation cache: XLA:CPU cannot serialize them again, "
                     r"so they compile again in the background for the program cache", log)
    assert hits and int(hits[1]) >= now, log[-3000:]
    done = re.search(rf"all {now + later} programs compiled \({later} in the background, [\d.]+ s; (\d+) from "
                     r"JAX's compilation cache compiled again for the program cache\)", log)
    assert done and int(done[1]) >= now, log[-3000:]
    assert re.search(rf"program cache written: {now + later} programs", log) and len(written) == 1, log[-3000:]


def test_the_third_start_loads_every_program_from_the_program_cache(starts):
    logs, answers, _ = starts
    second, third = COMPILED.search(logs["second"]), COMPILED.search(logs["third"])
    total = int(second[1]) + int(second[5] or 0)
    assert third and int(third[1]) == int(third[2]) == total and third[5] is None, logs["third"][-3000:]
    assert "from JAX's compilation cache" not in logs["third"]
    assert answers["third"] == answers["second"] == answers["second_after"]
