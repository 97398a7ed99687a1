"""LoRA through the real server and the official openai client: --lora-modules (both forms),
/v1/models with parents, a request's model naming an adapter, run-time load/unload under
VLLM_ALLOW_RUNTIME_LORA_UPDATING behind the API key, bad adapters as 400s that change nothing,
vllm:lora_requests_info."""

from __future__ import annotations

import json
import os
import re
import shutil

import httpx
import openai
import pytest

from jaxlm.serve.api_server import build_app
from jaxlm.serve.cli_args import make_arg_parser
from tests.helpers.lora_adapters import PeftReference, edit_adapter_config, make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama
from tests.serve.conftest import serve_engine

pytestmark = pytest.mark.timeout(600)
KEY = "sk-lora"
MODEL = "tiny-base"
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48]
N = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_adapters")
    a = {"sql": make_peft_adapter(tiny_llama, str(root / "sql"), seed=1, r=4, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj"]),
         "chat": make_peft_adapter(tiny_llama, str(root / "chat"), seed=2, r=8, lora_alpha=16,
                                   target_modules=["gate_proj", "up_proj", "down_proj"]),
         "late": make_peft_adapter(tiny_llama, str(root / "late"), seed=3, r=2, lora_alpha=4, use_rslora=True,
                                   target_modules=["k_proj", "o_proj"]),
         "rank16": make_peft_adapter(tiny_llama, str(root / "rank16"), seed=4, r=16, target_modules=["q_proj"])}
    narrow = make_tiny_llama(root / "narrow", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                             num_key_value_heads=1)
    a["other_shape"] = make_peft_adapter(narrow, str(root / "other_shape"), seed=5, r=4, target_modules=["q_proj"])
    for name, change in (("dora", dict(use_dora=True)), ("no_such_module", dict(target_modules=["q_proj", "wqkv"]))):
        a[name] = shutil.copytree(a["sql"], root / name)
        edit_adapter_config(str(a[name]), **change)
    a["no_config"] = shutil.copytree(a["sql"], root / "no_config")
    os.remove(os.path.join(a["no_config"], "adapter_config.json"))
    return {k: str(v) for k, v in a.items()}


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        json_form = json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": MODEL})
        srv = serve_engine(tiny_llama, ["--served-model-name", MODEL, "--api-key", KEY,
                                        "--lora-modules", f"sql={adapters['sql']}", json_form],
                           enable_lora=True, max_loras=2, max_lora_rank=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return PeftReference(tiny_llama)


def _client(server) -> openai.OpenAI:
    return server.client(api_key=KEY)


def _tokens(client, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0.0, logprobs=1,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def _post(server, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base + route, json=body, headers=headers, timeout=120)


def _model_ids(server) -> list[str]:
    return [m.id for m in _client(server).models.list().data]


def test_models_list_adapters_with_parent(server, adapters):
    cards = {m.id: m for m in _client(server).models.list().data}
    assert list(cards) == [MODEL, "sql", "chat"]
    assert cards["sql"].parent == MODEL and cards["chat"].parent == MODEL and cards[MODEL].parent is None
    assert cards["sql"].root == adapters["sql"]


def test_requests_run_with_the_adapter_they_name(server, adapters, reference):
    client = _client(server)
    got = {name: _tokens(client, name) for name in (MODEL, "sql", "chat")}
    for name, path in ((MODEL, None), ("sql", adapters["sql"]), ("chat", adapters["chat"])):
        assert got[name] == reference.greedy(path, PROMPT, N)[0], name
    assert len({tuple(t) for t in got.values()}) == 3
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "sql"
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_runtime_load_and_unload(server, adapters, reference):
    client = _client(server)
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]},
                 key=None).status_code == 401  # guarded by the API key
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in _model_ids(server)
    assert _tokens(client, "late") == reference.greedy(adapters["late"], PROMPT, N)[0]
    again = _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    assert "late" not in _model_ids(server)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="hi", max_tokens=2)
    gone = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    # Loaded again under the same name: a new id, the same outputs.
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]}).status_code == 200
    assert _tokens(client, "late") == reference.greedy(adapters["late"], PROMPT, N)[0]
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200


@pytest.mark.parametrize("name,match", [
    ("rank16", "LoRA rank 16 of .*q_proj is greater than max_lora_rank 8"),
    ("other_shape", "trained for a base model of another shape"),
    ("no_such_module", "target module 'wqkv' is not a layer of this model"),
    ("dora", "DoRA adapters"),
    ("no_config", "no adapter_config.json in"),
    ("missing", "is neither a local directory nor in the local Hugging Face cache"),
    ("nul_path", "is not a directory"),
    ("huge_path", "is not a directory"),
])
def test_bad_adapters_are_400s_that_change_nothing(server, adapters, reference, name, match):
    before = _model_ids(server)
    path = {"missing": "acme/missing", "nul_path": "/tmp/a\x00b", "huge_path": "/x" * 500_000}.get(name) or adapters[name]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_path" and len(error["message"]) < 2000
    assert re.search(match, error["message"]), error["message"]
    assert _model_ids(server) == before
    assert _tokens(_client(server), "sql") == reference.greedy(adapters["sql"], PROMPT, N)[0]


@pytest.mark.parametrize("body", [{}, {"lora_name": "x"}, {"lora_name": 5, "lora_path": "/x"},
                                  {"lora_name": "x", "lora_path": ["a"] * 3}, {"lora_name": "", "lora_path": ""}])
def test_load_body_must_name_both(server, body):
    r = _post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400 and "must be provided" in r.json()["error"]["message"]


def test_lora_requests_info_metric(server):
    info = [k for k in server.metrics() if k.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]


def test_routes_need_the_runtime_switch(monkeypatch):
    for var in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(var, raising=False)
    args = make_arg_parser().parse_args([])
    assert "/v1/load_lora_adapter" not in build_app(args).openapi()["paths"]
    monkeypatch.setenv("JAXLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(build_app(args).openapi()["paths"])


def test_load_needs_enable_lora(fake_server_factory, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    server = fake_server_factory()
    r = httpx.post(server.base + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}, timeout=30)
    assert r.status_code == 400 and "start the server with --enable-lora" in r.json()["error"]["message"]


def test_lora_requests_info_labels():
    from jaxlm.serve.metrics import _lora_info

    sample = _lora_info({"max_lora": 4, "running": {"sql": 2, "chat": 1}, "waiting": {"late": 3}}).samples[0]
    assert sample.labels == {"max_lora": "4", "running_lora_adapters": "chat,sql", "waiting_lora_adapters": "late"}
