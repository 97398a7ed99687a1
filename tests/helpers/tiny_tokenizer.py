"""A tiny byte-level BPE tokenizer trained in-process (no downloads), saved beside a tiny model."""

from __future__ import annotations

import os
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.helpers.tiny_models import make_tiny_model

TINY_VOCAB = 384
_SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny configs' pad/bos/eos
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello, my name is Ada and I like to write programs in Python.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "A paged KV cache holds keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join at every step of the engine.",
    "日本語のテキストと emoji 🙂 も少し含める。",
] * 20
_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def add_tiny_tokenizer(path: str | os.PathLike) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=_CHAT_TEMPLATE)
    fast.save_pretrained(str(path))
    return str(path)


def make_tiny_engine_model(family: str, path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """A tiny random model of `family` with a real tokenizer beside it: what LLM(model=path) needs."""
    overrides.setdefault("vocab_size", TINY_VOCAB)
    make_tiny_model(family, path, seed=seed, **overrides)
    return add_tiny_tokenizer(path)
