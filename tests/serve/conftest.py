"""A real uvicorn server on 127.0.0.1 (free port) in a background thread, for the openai client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.serve.api_server import build_app, build_server, create_server_socket, init_app_state
from jaxlm.serve.cli_args import make_arg_parser
from jaxlm.serve.metrics import parse_metrics
from tests.serve.server_process import ServerProcess


# Engine arguments of the tiny servers (few buckets keep the warm-up compile short on 2 cores).
TINY_ENGINE_ARGS: dict[str, Any] = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
                                        num_gpu_blocks_override=160, token_buckets=[16, 64], seq_buckets=[16],
                                        seed=0)


class ServerThread:
    """The app and uvicorn in a thread of this process over an AsyncLLMEngine (whose core runs
    in its own process when built by `serve_engine`); stop() also shuts the engine down when
    the server owns it."""

    def __init__(self, engine: AsyncLLMEngine, cli: list[str] | None = None, *, owns_engine: bool = False) -> None:
        args = make_arg_parser().parse_args(
            ["--port", "0", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *(cli or [])])
        self.engine = engine
        self.owns_engine = owns_engine
        self.app = build_app(args)
        init_app_state(engine, self.app.state, args)
        self.sock = create_server_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = build_server(self.app, args)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def client(self, api_key: str = "EMPTY", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=60)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.base + "/metrics", timeout=10).text)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        if self.owns_engine:
            self.engine.shutdown()


def serve_engine(model: str, cli: list[str] | None = None, **engine_kw: Any) -> ServerThread:
    """A ServerThread over a real engine on `model` (its core in a process of its own), built
    from TINY_ENGINE_ARGS with engine_kw on top; the server owns the engine."""
    from jaxlm.engine.arg_utils import EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model, **{**TINY_ENGINE_ARGS, **engine_kw}))
    try:
        return ServerThread(engine, cli, owns_engine=True)
    except BaseException:
        engine.shutdown()
        raise


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """The value of one sample, matching `name` and a subset of labels."""
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return value
    raise KeyError(name)


def async_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="EMPTY", max_retries=0, timeout=120,
                              http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=128)))


def concurrent_streams(base: str, model: str, prompts: list[str], max_tokens: int, drop: set[int],
                       **kw: Any) -> list[str | None]:
    """One streamed completion per prompt, all at once; those whose index is in `drop` close
    their stream after two chunks (the client goes away: None). kw: more request fields."""
    async def one(aclient: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await aclient.completions.create(model=model, prompt=prompts[i], max_tokens=max_tokens,
                                                  stream=True, **kw)
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            if i in drop and len(parts) >= 2:
                break
        if i in drop:
            await stream.close()
            return None
        return "".join(parts)

    async def main() -> list[str | None]:
        async with async_client(base) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(len(prompts)))), 300)

    return asyncio.run(main())


# An idle core reports every second (EngineCoreProc.HEARTBEAT_S); the rest is slack for a busy CI.
IDLE_GAUGES_TIMEOUT_S = 3.0


def assert_idle_gauges(get_values: Callable[[], dict[str, float]],
                       timeout: float = IDLE_GAUGES_TIMEOUT_S) -> dict[str, float]:
    """With no request sent meanwhile, every engine's vllm:num_requests_running,
    vllm:num_requests_waiting and vllm:kv_cache_usage_perc read 0 within `timeout`."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    start = time.monotonic()
    while True:
        values = get_values()
        busy = {k: v for k, v in values.items() if k.partition("{")[0] in names and v != 0}
        if not busy:
            assert any(k.startswith(names[0]) for k in values), "no gauges on /metrics"
            return values
        assert time.monotonic() - start < timeout, f"still reported {timeout} s after the last request: {busy}"
        time.sleep(0.1)


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random llama (float32) with the BPE tokenizer, built once per session. Read-only:
    a test that changes its files builds its own."""
    from tests.helpers.tiny_models import make_tiny_engine_model

    return make_tiny_engine_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

    return add_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def fake_server_factory(tiny_tokenizer_dir: str) -> Iterator[Callable[..., ServerThread]]:
    """Servers over FakeLLMEngine (unit-test double); stopped at teardown."""
    from tests.serve.fake_engine import FakeLLMEngine

    started: list[ServerThread] = []

    def make(cli: list[str] | None = None, **engine_kw: Any) -> ServerThread:
        engine = AsyncLLMEngine(lambda: FakeLLMEngine(tiny_tokenizer_dir, **engine_kw))
        server = ServerThread(engine, cli)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
        server.engine.shutdown()


# Step budget of the shared server: prompts longer than it are prefilled over several steps.
SERVER_STEP_BUDGET = 16
SERVED_MODEL = "tiny-llama"


@pytest.fixture(scope="session")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One subprocess server shared by the compatibility, metrics and lm-eval tests (one compile):
    a tiny random llama (float32), a 16-token step budget, the tokenizer-info endpoint on."""
    from tests.helpers.tiny_models import make_tiny_engine_model

    path = make_tiny_engine_model("llama", tmp_path_factory.mktemp("served-llama"))
    _add_bos_post_processor(path)
    server = ServerProcess(path, [
        "--served-model-name", SERVED_MODEL, "--max-model-len", "256", "--max-num-seqs", "16",
        "--max-num-batched-tokens", str(SERVER_STEP_BUDGET), "--token-buckets", str(SERVER_STEP_BUDGET),
        "--seq-buckets", "16", "--num-gpu-blocks-override", "512", "--seed", "0",
        "--enable-tokenizer-info-endpoint",
        # Default sampling from the "generation config": top_k 1 makes requests that set no
        # sampling field greedy (the compat tests check it; explicit fields override it).
        "--override-generation-config", '{"top_k": 1}'])
    yield server
    server.stop()


def _add_bos_post_processor(path: str) -> None:
    """The tokenizer adds <s> when add_special_tokens is on (as Llama's), so the flag shows."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)])
    tok.save_pretrained(path)
