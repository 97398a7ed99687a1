"""Fuzzing the server through its own OpenAPI schema (issue 17): schemathesis draws valid and
invalid requests for every operation and sends them through the ASGI app (over the fake engine,
with the real admission path, routes, middleware and error handlers): no case may get a 5xx, and
the server is healthy afterwards. At least 1,000 cases."""

from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.serve.api_server import build_app, init_app_state
from jaxlm.serve.cli_args import make_arg_parser

# The pooling routes' schemas (issue 39) made case generation slower: 6-7 min at load 25.
pytestmark = pytest.mark.timeout(900)
NUM_CASES = 1_100
KEY = "fuzz-key"


@pytest.fixture
def app(tiny_tokenizer_dir):
    from tests.serve.fake_engine import FakeLLMEngine

    args = make_arg_parser().parse_args(["--api-key", KEY, "--max-prompts-per-request", "8"])
    engine = AsyncLLMEngine(lambda: FakeLLMEngine(tiny_tokenizer_dir, max_model_len=64, step_delay=0.0))
    app = build_app(args)
    init_app_state(engine, app.state, args)
    yield app
    engine.shutdown()


def test_fuzzed_requests_never_get_a_5xx(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"authorization": f"Bearer {KEY}"})
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    strategies = [op.as_strategy(generation_mode=mode, headers={"authorization": f"Bearer {KEY}"})
                  for op in operations for mode in schemathesis.GenerationMode]
    statuses: collections.Counter = collections.Counter()
    server_errors: list[str] = []

    @settings(max_examples=NUM_CASES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies))
    def run(case) -> None:
        response = case.call()
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            server_errors.append(f"{case.method} {case.path} {case.body!r:.300}: {response.text[:300]}")

    run()
    total = sum(statuses.values())
    print(f"\nfuzzed cases: {total}, statuses: {dict(sorted(statuses.items()))}")
    assert not server_errors, "\n".join(server_errors[:10])
    assert total >= 1_000
    assert app.state.engine.is_running
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        greedy = {"prompt": "the quick", "max_tokens": 4, "temperature": 0.0}
        r = client.post("/v1/completions", json=greedy, headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
