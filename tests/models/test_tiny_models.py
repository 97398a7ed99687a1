"""The shared tiny-model helper writes what engine tests rely on."""

from __future__ import annotations

import os

import transformers

from tests.helpers import tiny_models as tm
from tests.helpers import tiny_tokenizer as tt


def test_tiny_llama_dir_has_weights_config_and_a_round_tripping_tokenizer(tmp_path) -> None:
    path = tm.make_tiny_llama(tmp_path / "m", tie_word_embeddings=True)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(path))
    cfg = transformers.AutoConfig.from_pretrained(path)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = "Hi ünïcode! 123"
    ids = tok(text)["input_ids"]
    assert ids[:2] == [ord("H") + tt.BYTE_OFFSET, ord("i") + tt.BYTE_OFFSET]
    assert max(ids) < cfg.vocab_size
    assert tok.decode(ids) == text
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (tm.EOS_ID, tm.BOS_ID, tm.PAD_ID)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<s>user\nhi</s>\n<s>assistant\n"


def test_same_seed_same_weights(tmp_path) -> None:
    from safetensors.numpy import load_file

    a = load_file(os.path.join(tm.make_tiny_gpt2(tmp_path / "a", with_tokenizer=False), "model.safetensors"))
    b = load_file(os.path.join(tm.make_tiny_gpt2(tmp_path / "b", with_tokenizer=False), "model.safetensors"))
    assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a)
    assert not os.path.exists(tmp_path / "a" / "tokenizer.json")


def test_small_vocab_gets_no_tokenizer_unless_asked(tmp_path) -> None:
    import pytest

    path = tm.make_tiny_llama(tmp_path / "small", vocab_size=200)
    assert not os.path.exists(os.path.join(path, "tokenizer.json"))
    with pytest.raises(ValueError, match="too small for the byte tokenizer"):
        tm.make_tiny_llama(tmp_path / "small2", vocab_size=200, with_tokenizer=True)
