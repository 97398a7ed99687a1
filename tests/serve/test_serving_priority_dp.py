"""One server with -dp 2, --scheduling-policy priority and --skip-tokenizer-init on a checkpoint
without tokenizer files: request priorities cross the engine-core processes (each core orders
its own queue), token ids go in and out, and what needs text gets a 400 naming the field."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.helpers.tiny_models import make_tiny_model
from tests.helpers.tiny_tokenizer import TINY_VOCAB
from tests.serve.conftest import SERVED_MODEL as SHARED_MODEL
from tests.serve.conftest import serve_engine, wait_for

pytestmark = pytest.mark.timeout(600)
MODEL = "bare"
PROMPT = [5, 17, 42, 99, 7, 12, 230, 64]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # tiny_llama's weights (same seed and shapes), without any tokenizer file.
    path = make_tiny_model("llama", tmp_path_factory.mktemp("bare"), with_tokenizer=False, vocab_size=TINY_VOCAB)
    assert not [f for f in os.listdir(path) if "token" in f]
    # One sequence slot per core, so queued requests wait in each core's priority queue. Every
    # model step 50 ms longer in the cores (fault_patch.py's "slow", which sitecustomize.py imports
    # in each spawned core): the low-priority requests still queue when the high ones arrive,
    # however fast the machine.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXLM_TEST_FAULT", "slow")
        mp.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                 os.environ.get("PYTHONPATH", "")]))
        srv = serve_engine(path, ["--served-model-name", MODEL], data_parallel_size=2, scheduling_policy="priority",
                           skip_tokenizer_init=True, max_num_seqs=1, seq_buckets=[1], token_buckets=[16],
                           max_num_batched_tokens=16)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=120) as client:
        yield client


def _complete(http, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0.0,
                                               "ignore_eos": True, **body})


def test_token_ids_in_and_out(http, real_server):
    r = _complete(http, max_tokens=6, return_token_ids=True, logprobs=1, echo=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 6
    # Logprob tokens fall back to "token_id:N" without a tokenizer.
    assert choice["logprobs"]["tokens"][len(PROMPT):] == [f"token_id:{t}" for t in choice["token_ids"]]
    # The same weights behind the shared server (with its tokenizer) give the same tokens.
    shared = httpx.post(real_server.base + "/v1/completions", timeout=120, json={
        "model": SHARED_MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True}).json()["choices"][0]
    assert shared["token_ids"] == choice["token_ids"] and shared["text"]
    beams = _complete(http, max_tokens=4, n=2, use_beam_search=True, return_token_ids=True).json()["choices"]
    assert len(beams) == 2 and beams[0]["token_ids"] != beams[1]["token_ids"]
    assert all(b["text"] == "" for b in beams)


@pytest.mark.parametrize("endpoint,body,param", [
    ("/v1/completions", {"prompt": "some text"}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["x"]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "bad_words": ["x"]}, "bad_words"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {"prompt": "some text"}, "prompt"),
    ("/detokenize", {"tokens": PROMPT}, "tokens"),
])
def test_text_needs_a_tokenizer(http, endpoint, body, param):
    r = http.post(endpoint, json={"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "skip" in error["message"].lower(), error


def test_priority_orders_each_core_across_the_process_boundary(http, server):
    """Ten low-priority requests queue first (least-loaded routing: five per core, one running in
    each core's one slot), then two high-priority ones (one per core). Each core admits its high
    one as soon as its running request ends, so between the highs' arrival and their end at most
    two lows per core finish (the one running, and one whose response was still on its way);
    under fcfs all ten would."""
    finished: dict[str, float] = {}
    errors: list[str] = []

    def send(name: str, priority: int, max_tokens: int) -> threading.Thread:
        def run() -> None:
            r = _complete(http, max_tokens=max_tokens, priority=priority)
            if r.status_code != 200:
                errors.append(r.text)
            finished[name] = time.monotonic()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    lows = [send(f"low{i}", 5, 20) for i in range(10)]  # >= 1 s each (slow steps)
    # All ten are in the front end's queue of commands, so each core gets its lows before its high.
    assert wait_for(lambda: server.engine.get_num_unfinished_requests() + len(finished) == 10)
    lows_done_before = len(finished)
    highs = [send(f"high{i}", -5, 8) for i in range(2)]
    for thread in lows + highs:
        thread.join(120)
    assert not errors, errors
    last_high = max(finished["high0"], finished["high1"])
    lows_before_highs = sum(1 for name, t in finished.items() if name.startswith("low") and t < last_high)
    assert lows_before_highs <= lows_done_before + 4, (lows_done_before, lows_before_highs, finished)
    assert lows_done_before + 4 < 10  # the order showed: fcfs would finish all ten lows first
    # Both cores served.
    queries = {k: v for k, v in server.metrics().items() if k.startswith("vllm:prefix_cache_queries_total{engine=")}
    assert len(queries) == 2 and all(v > 0 for v in queries.values()), queries
