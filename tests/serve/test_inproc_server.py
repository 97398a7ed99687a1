"""The server over an engine in this process (LLMEngine's InprocClient, as LLM uses it) on a
base model: a tiny llama whose tokenizer has no chat template. Several front ends share the
engine, each with its own flags: --chat-template and the chat paths that use it, request logging;
the engine's periodic stats line, and the gauges of an idle engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time

import jinja2
import openai
import pytest

from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.serve.protocol import MAX_REQUEST_ID_LEN
from tests.serve.conftest import (
    TINY_ENGINE_ARGS,
    ServerThread,
    assert_idle_gauges,
    async_client,
    concurrent_streams,
    metric,
)

pytestmark = pytest.mark.timeout(600)
MODEL = "base"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if tools %}<tools:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}>{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def base_model(tiny_llama, tmp_path_factory) -> str:
    from tests.helpers.tiny_models import copy_without_chat_template

    return copy_without_chat_template(tiny_llama, tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture(scope="module")
def engine(base_model):
    """Default observability flags: the stats line is on (every 0.2 s here)."""
    from jaxlm.engine.llm_engine import LLMEngine

    args = EngineArgs(model=base_model, **TINY_ENGINE_ARGS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXLM_LOG_STATS_INTERVAL", "0.2")  # read when the engine is built
        eng = AsyncLLMEngine(lambda: LLMEngine.from_engine_args(args))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def templated(engine, template_file):
    """--chat-template, with tool calling and a reasoning parser on: every chat path renders it."""
    srv = ServerThread(engine, ["--served-model-name", MODEL, "--chat-template", template_file,
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--reasoning-parser", "deepseek_r1", "--enable-tokenizer-info-endpoint"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(engine):
    srv = ServerThread(engine, ["--served-model-name", MODEL])
    yield srv
    srv.stop()


@contextlib.contextmanager
def slow_steps(engine):
    """Every model step takes 50 ms longer inside (fault_patch.py's "slow", for this process's
    engine): 100 tokens outlast a client that leaves after two, and 20 tokens span several
    0.2 s stats intervals, however fast the machine."""
    runner = engine.engine.get_model_runner()
    real = runner.execute_model

    def slowed(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "execute_model", slowed)
        yield


def _flag_ids(engine, tools=None) -> list[int]:
    """The token ids of the flag's template rendered independently (plain Jinja), without BOS."""
    text = jinja2.Template(TEMPLATE).render(messages=MESSAGES, tools=tools, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_chat_template_flag_renders_chat_tokenize_tools_and_reasoning(templated, engine, template_file):
    client = templated.client()
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0.0)
    assert out.usage.prompt_tokens == len(_flag_ids(engine))
    # Tools reach the flag's template; tool_choice "none" keeps the output plain text.
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         max_tokens=3, temperature=0.0)
    assert out.usage.prompt_tokens == len(_flag_ids(engine, TOOLS)) > len(_flag_ids(engine))
    # Streamed with usage: the same prompt.
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == len(_flag_ids(engine))
    with templated.http() as http:
        tok = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
        assert tok["tokens"] == _flag_ids(engine) and tok["count"] == len(tok["tokens"])
        info = http.get("/tokenizer_info").json()
    with open(template_file, encoding="utf-8") as f:
        assert info["chat_template"] == f.read()


def test_no_chat_template_is_a_400_naming_the_flag(plain):
    client = plain.client()
    with pytest.raises(openai.BadRequestError, match="--chat-template") as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert e.value.body["param"] == "messages"
    with plain.http() as http:
        r = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
        # The engine goes on serving what needs no template.
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def logged(engine):
    srv = ServerThread(engine, ["--served-model-name", MODEL, "--enable-log-requests", "--max-log-len", "8"])
    yield srv
    srv.stop()


def test_enable_log_requests_logs_arrivals_cut_to_max_log_len_and_aborts(logged, plain, engine, caplog):
    caplog.set_level(logging.INFO, logger="jaxlm")
    prompt = "The capital of France is Paris."
    ids = engine.tokenizer.encode(prompt)
    client = logged.client()
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
    with slow_steps(engine):  # the dropped stream is still running when its client leaves
        concurrent_streams(logged.base, MODEL, [prompt], 100, drop={0}, temperature=0.0,
                           extra_body={"ignore_eos": True})
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxlm.serve.request_logger"]
    received = [line for line in lines if line.startswith("Received request")]
    assert len(received) == 2, lines
    assert received[0].startswith(f"Received request {out.id}-0: prompt: 'The capi', params: SamplingParams(")
    assert re.search(r"prompt_token_ids: \[([0-9]+, ){7}[0-9]+\]$", received[0]), received[0]
    assert received[0].endswith(f"prompt_token_ids: {ids[:8]}")
    assert any(line.startswith("Aborted request cmpl-") for line in lines), lines
    caplog.clear()
    plain.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert not [r for r in caplog.records if r.name == "jaxlm.serve.request_logger"]


def test_x_request_id_names_the_response_and_the_log_line(logged, templated, caplog):
    """vLLM's _base_request_id: the header's id, prefixed, in the response and the request log;
    8 concurrent requests sharing it each get their own answer (the engine's ids stay unique)."""
    caplog.set_level(logging.INFO, logger="jaxlm")
    prompts = [f"The capital of France is {i}" for i in range(8)]
    client, greedy = logged.client(), dict(temperature=0.0, extra_body={"ignore_eos": True})
    reference = [client.completions.create(model=MODEL, prompt=p, max_tokens=4 + i, **greedy).choices[0].text
                 for i, p in enumerate(prompts)]
    header = {"X-Request-Id": "gateway-trace-42"}

    async def together() -> list:
        async with async_client(logged.base) as aclient:
            return await asyncio.gather(*(
                aclient.completions.create(model=MODEL, prompt=p, max_tokens=4 + i, extra_headers=header, **greedy)
                for i, p in enumerate(prompts)))

    outs = asyncio.run(together())
    assert [o.id for o in outs] == ["cmpl-gateway-trace-42"] * 8
    assert [o.choices[0].text for o in outs] == reference and [o.usage.completion_tokens for o in outs] == list(
        range(4, 12))
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxlm.serve.request_logger"]
    assert sum(line.startswith("Received request cmpl-gateway-trace-42-0: ") for line in lines) == 8, lines
    chat = templated.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                      extra_headers=header)
    assert chat.id == "chatcmpl-gateway-trace-42"
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True, extra_headers=header)
    assert {chunk.id for chunk in stream} == {"cmpl-gateway-trace-42"}
    # The header wins over the body's request_id, as in vLLM.
    both = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_headers=header,
                                     extra_body={"request_id": "body-id"})
    plain_id = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"request_id": "body-id"})
    assert (both.id, plain_id.id) == ("cmpl-gateway-trace-42", "cmpl-body-id")


def test_a_request_id_past_the_bound_is_a_400(templated):
    long_id = "x" * (MAX_REQUEST_ID_LEN + 1)
    with templated.http() as http:
        for path, body in (("/v1/completions", {"prompt": "Hi"}),
                           ("/v1/chat/completions", {"messages": MESSAGES})):
            r = http.post(path, json={"model": MODEL, "max_tokens": 2, **body}, headers={"X-Request-Id": long_id})
            assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"], r.text
            assert str(MAX_REQUEST_ID_LEN) in r.json()["error"]["message"]
            r = http.post(path, json={"model": MODEL, "max_tokens": 2, "request_id": long_id, **body})
            assert r.status_code == 400 and "request_id" in r.text, r.text
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                       headers={"X-Request-Id": "x" * MAX_REQUEST_ID_LEN})
        assert ok.status_code == 200 and ok.json()["id"] == "cmpl-" + "x" * MAX_REQUEST_ID_LEN, ok.text


def test_stats_line_is_logged_while_the_engine_works(plain, engine, caplog):
    """The engine's periodic line (on by default; --disable-log-stats: test_engine_core_proc.py).
    Its interval is 0.2 s here; 20 steps of at least 50 ms each span several, however fast the
    machine (unslowed, a fast one finished four streams of 100 tokens inside one interval)."""
    caplog.set_level(logging.INFO, logger="jaxlm")
    with slow_steps(engine):
        concurrent_streams(plain.base, MODEL, ["The capital of France is"] * 4, 20, drop=set(), temperature=0.0,
                           extra_body={"ignore_eos": True})
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(line.startswith("Avg prompt throughput: ") and "Running: " in line for line in lines), lines


def test_idle_gauges_after_disconnects(plain):
    """In-process core: 0 running, 0 waiting and 0 KV usage once the last streams are dropped."""
    prompts = [f"The capital of France is {i}" for i in range(16)]
    concurrent_streams(plain.base, MODEL, prompts, 100, drop=set(range(16)), temperature=0.0,
                       extra_body={"ignore_eos": True})
    values = assert_idle_gauges(plain.metrics)
    assert metric(values, "vllm:num_requests_running", engine="0", model_name=MODEL) == 0.0


def test_an_unreadable_message_is_a_400_naming_messages(templated):
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with templated.http() as http:
        for path, body in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
            r = http.post(path, json={"model": MODEL, "messages": bad, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "image_url" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 200
