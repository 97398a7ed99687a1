"""Models by name: ``org/name`` found in a (fake) local Hugging Face cache, offline."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import NoWeightsError, get_model, get_tokenizer, resolve_model_config
from jaxlm.model_loader.hf_cache import looks_like_repo_id, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tiny_llama_dir, tmp_path, monkeypatch) -> str:
    """HF_HUB_CACHE holding models--org--tiny at refs/main, laid out as huggingface_hub writes it."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: the lookup must not need the network
    return str(repo / "snapshots" / COMMIT)


def test_repo_id_resolves_to_the_snapshot(hf_cache):
    mc = resolve_model_config(ModelConfig(model="org/tiny"), LoadConfig())
    assert os.path.samefile(mc.model, hf_cache)
    assert mc.served_model_name == ["org/tiny"]  # vLLM: the string the user gave
    assert type(mc.hf_config).__name__ == "LlamaConfig"
    assert get_tokenizer(mc)("hello world")["input_ids"]
    model = get_model(mc, LoadConfig(), attn_backend=None)
    assert model.args.num_layers == mc.hf_config.num_hidden_layers


def test_tokenizer_by_name(hf_cache, tiny_llama_dir):
    tok = get_tokenizer(ModelConfig(model=tiny_llama_dir, tokenizer="org/tiny"))
    assert tok("hello")["input_ids"]


def test_explicit_revision(hf_cache):
    assert os.path.samefile(resolve_model_path("org/tiny", COMMIT), hf_cache)
    with pytest.raises(NoWeightsError, match="not found at revision 'v2' in the local Hugging Face cache"):
        resolve_model_path("org/tiny", "v2")


def test_missing_model_gets_the_clear_message(hf_cache):
    cache = os.environ["HF_HUB_CACHE"]
    want = (
        rf"^org/absent: not found in the local Hugging Face cache \(HF_HUB_CACHE={re.escape(cache)}\); "
        r"jaxlm never downloads: run `huggingface-cli download org/absent` on a machine with network, "
        r"or pass a local path$"
    )
    with pytest.raises(NoWeightsError, match=want):
        resolve_model_config(ModelConfig(model="org/absent"), LoadConfig())


def test_hf_home_is_honoured(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    repo = tmp_path / "hfhome" / "hub" / "models--org--tiny"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    assert os.path.samefile(resolve_model_path("org/tiny"), repo / "snapshots" / COMMIT)


def test_local_paths_are_not_repo_ids(tiny_llama_dir, tmp_path):
    assert not looks_like_repo_id(tiny_llama_dir)
    assert not looks_like_repo_id(str(tmp_path / "absent"))
    assert not looks_like_repo_id("./org/name") and not looks_like_repo_id("~/models/x")
    assert not looks_like_repo_id("model.gguf")
    assert looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and looks_like_repo_id("gpt2")
