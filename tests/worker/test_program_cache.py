"""The program cache through LLM (worker/program_cache.py). Four engine starts in one fresh
process (tests/helpers/program_cache_cases.py): the second start loads every compiled program
from the first one's file, samples the same tokens and logprobs and compiles nothing while
serving; a start that defers its programs loads each on first use or while idle, with the
same samples; another config gets none of them; a torn file is removed and the programs compiled."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.tiny_models import make_tiny_engine_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("program_cache")
    model = make_tiny_engine_model("llama", tmp / "tiny")
    out = tmp / "out.json"
    # One device, as the cache requires (other test modules widen XLA_FLAGS to 8 host devices).
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    subprocess.run([sys.executable, "-m", "tests.helpers.program_cache_cases", model, str(tmp / "xla"), str(out)],
                   cwd=ROOT, check=True, timeout=600, env=dict(os.environ, XLA_FLAGS=flags))
    results = json.loads(out.read_text())
    eight = tmp / "eight.json"
    subprocess.run([sys.executable, "-m", "tests.helpers.program_cache_cases", model, str(tmp / "xla8"), str(eight),
                    "eight"], cwd=ROOT, check=True, timeout=600,
                   env=dict(os.environ, XLA_FLAGS=flags + " --xla_force_host_platform_device_count=8"))
    results["eight_devices"] = json.loads(eight.read_text())
    return results


def test_several_local_devices_turn_the_cache_off(starts):
    # A loaded executable would bind to all eight devices and refuse the runner's one-device inputs.
    assert starts["eight_devices"]["from_cache"] == 0 and starts["eight_devices"]["files"] == [], starts


def test_the_first_start_writes_one_file(starts):
    first = starts["first"]
    assert first["from_cache"] == 0 and first["programs"] > 0 and len(first["files"]) == 1, first


def test_a_second_start_loads_every_program_and_samples_the_same(starts):
    first, second = starts["first"], starts["second"]
    assert second["from_cache"] == second["programs"] == first["programs"]
    assert second["compiles"] == first["compiles"] == 0
    assert (second["tokens"], second["logprobs"]) == (first["tokens"], first["logprobs"])
    assert second["files"] == first["files"]


def test_a_deferred_start_loads_programs_on_use_and_while_idle(starts):
    # defer_program_load (the server's default): one program is loaded at start (it proves the
    # file loads), the step's own programs on first use, the rest by load_deferred_program().
    first, deferred = starts["first"], starts["deferred"]
    assert deferred["from_cache"] == deferred["programs"] == first["programs"] and deferred["compiles"] == 0
    assert (deferred["tokens"], deferred["logprobs"]) == (first["tokens"], first["logprobs"])
    assert deferred["at_start"] == 1 < deferred["after_requests"] < deferred["programs"], deferred
    assert deferred["after_requests"] + deferred["idle_loads"] == deferred["at_end"] == deferred["programs"]
    assert deferred["pending"] == 0 and deferred["files"] == first["files"]  # one entry for both ways


def test_another_config_compiles_and_writes_nothing_from_jax_cache(starts):
    # Its body programs come from JAX's cache: an executable loaded from there serializes without
    # its functions on XLA:CPU, so no file is written for it (the first one stays).
    other = starts["other"]
    assert other["from_cache"] == 0 and other["programs"] > starts["first"]["programs"]
    assert other["tokens"][0] == starts["first"]["tokens"][0]  # greedy
    assert other["files"] == starts["first"]["files"]


def test_a_torn_file_is_removed_and_the_programs_compiled(starts):
    torn, first = starts["torn"], starts["first"]
    assert torn["from_cache"] == 0 and torn["compiles"] == 0
    assert (torn["tokens"], torn["logprobs"]) == (first["tokens"], first["logprobs"])
    assert torn["files"] == []


def test_prune_keeps_the_most_recently_used(tmp_path):
    from jaxlm.worker.program_cache import prune

    for i in range(5):
        (tmp_path / f"{i}.pkl").write_bytes(b"x")
        os.utime(tmp_path / f"{i}.pkl", (1000 + i, 1000 + i))
    os.utime(tmp_path / "0.pkl")  # just loaded
    (tmp_path / "other.txt").write_bytes(b"x")
    prune(str(tmp_path), 3)
    assert sorted(os.listdir(tmp_path)) == ["0.pkl", "3.pkl", "4.pkl", "other.txt"]
