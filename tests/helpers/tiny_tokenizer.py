"""Every tokenizer the tests use, built in-process (no downloads) with one chat template.

- ``write_byte_tokenizer``: one token per byte (ids 3..258), no merges; beside tiny models whose
  tests feed token ids and only need a decodable vocabulary.
- ``add_tiny_tokenizer``: a byte-level BPE trained on a small corpus (384 ids, multi-byte
  tokens, so detokenization and stop strings cross token boundaries like a real model's).
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny configs' pad/bos/eos
BYTE_OFFSET = 3  # byte b is token id b + 3 in the byte tokenizer
BYTE_VOCAB = BYTE_OFFSET + 256
TINY_VOCAB = 384
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello, my name is Ada and I like to write programs in Python.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "A paged KV cache holds keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join at every step of the engine.",
    "日本語のテキストと emoji 🙂 も少し含める。",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _save(tok: Tokenizer, path: str | os.PathLike) -> str:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(path))
    return str(path)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 bytes (what the ByteLevel pre-tokenizer emits).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_byte_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> str:
    """Save a byte-level fast tokenizer (no merges: one token per byte) into ``path``. With
    vocab_size, ids past the bytes decode to words " w<id>" (never produced by encoding): a
    random model's every token then has text, as a server benchmark counting chunks needs."""
    vocab = {name: i for i, name in enumerate(_SPECIALS)}
    for b, ch in _bytes_to_unicode().items():
        vocab[ch] = BYTE_OFFSET + b
    space = _bytes_to_unicode()[ord(" ")]
    vocab.update({f"{space}w{i}": i for i in range(BYTE_VOCAB, vocab_size or 0)})
    return _save(Tokenizer(models.BPE(vocab=vocab, merges=[])), path)


def add_tiny_tokenizer(path: str | os.PathLike) -> str:
    """Save a BPE tokenizer of TINY_VOCAB ids trained on a small corpus into ``path``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return _save(tok, path)
