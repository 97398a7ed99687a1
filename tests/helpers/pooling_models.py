"""Tiny random pooling models for tests, built with transformers (never downloaded): BERT and
XLM-RoBERTa encoders saved as sentence-transformers checkpoints (modules.json, 1_Pooling,
2_Normalize), their cross-encoder heads, decoder embedders and decoder classifiers."""

from __future__ import annotations

import json
import os
import string
from typing import Any

import torch
import transformers

from tests.helpers.tiny_tokenizer import write_byte_tokenizer

# Ids 0-3 as XLM-RoBERTa's (<s>, <pad>, </s>, <unk>), so one WordPiece vocabulary serves both
# families (XLM-R derives positions from pad_token_id = 1).
_SPECIALS = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]
_WORDS = ("the a an of to and in is it that was for on are with as his they be at one have this from or "
          "had by word but what some we can out other were all there when up use your how said each she "
          "query document search river bank money city paris france capital tower music cat dog").split()
WORDPIECE_VOCAB = _SPECIALS + list(string.ascii_lowercase + string.digits + ".,!?'-") + \
    ["##" + c for c in string.ascii_lowercase + string.digits] + _WORDS

_ENCODER_COMMON: dict[str, Any] = dict(
    vocab_size=len(WORDPIECE_VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=130, initializer_range=0.2, pad_token_id=1,
    bos_token_id=0, eos_token_id=2,
)


def write_wordpiece_tokenizer(path: str, token_types: bool = True) -> None:
    with open(os.path.join(path, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(WORDPIECE_VOCAB) + "\n")
    # XLM-R's tokenizer gives no token types (its model has one).
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    tok = transformers.BertTokenizerFast(os.path.join(path, "vocab.txt"), do_lower_case=True,
                                         cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                                         unk_token="[UNK]", mask_token="[MASK]", model_max_length=128,
                                         model_input_names=names)
    tok.save_pretrained(path)


def _randomize(model: torch.nn.Module) -> None:
    """LayerNorm weights are ones and biases zeros by default: randomize so a wrong mapping shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name or name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))


def _encoder_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    kw = dict(_ENCODER_COMMON, **overrides)
    if family == "bert":
        return transformers.BertConfig(type_vocab_size=2, **kw)
    if family == "xlmr":
        return transformers.XLMRobertaConfig(type_vocab_size=1, **kw)
    raise ValueError(family)


def make_tiny_encoder(path: str | os.PathLike, family: str = "bert", *, pooling: str | None = "mean",
                      normalize: bool = False, seed: int = 0, **overrides: Any) -> str:
    """A BertModel / XLMRobertaModel; ``pooling`` (cls, mean, lasttoken): saved as a
    sentence-transformers checkpoint with that pooling (and a Normalize module if asked)."""
    path = str(path)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(_encoder_config(family, **overrides)).float().eval()
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    write_wordpiece_tokenizer(path, token_types=family == "bert")
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
            os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        with open(os.path.join(path, "modules.json"), "w") as f:
            json.dump(modules, f)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": model.config.hidden_size, "pooling_mode": pooling,
                       "include_prompt": True}, f)
        with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
            json.dump({"max_seq_length": 128, "do_lower_case": False}, f)
    return path


def make_tiny_cross_encoder(path: str | os.PathLike, family: str = "bert", *, num_labels: int = 1,
                            seed: int = 0, **overrides: Any) -> str:
    """BertForSequenceClassification / XLMRobertaForSequenceClassification (a reranker)."""
    path = str(path)
    torch.manual_seed(seed)
    config = _encoder_config(family, num_labels=num_labels, **overrides)
    model = transformers.AutoModelForSequenceClassification.from_config(config).float().eval()
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    write_wordpiece_tokenizer(path, token_types=family == "bert")
    return path


_DECODERS = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, {}),
}
_DECODER_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)


def make_tiny_decoder_pooler(path: str | os.PathLike, family: str = "qwen3", *, head: str = "embed",
                             num_labels: int = 1, seed: int = 0) -> str:
    """A decoder saved as ``*Model`` (head="embed"), ``*ForSequenceClassification`` (head="classify")
    or ``*ForCausalLM`` (head="causal"), with the byte tokenizer."""
    path = str(path)
    cfg_cls, extra = _DECODERS[family]
    config = cfg_cls(**_DECODER_COMMON, **extra, num_labels=num_labels)
    torch.manual_seed(seed)
    auto = {"embed": transformers.AutoModel, "classify": transformers.AutoModelForSequenceClassification,
            "causal": transformers.AutoModelForCausalLM}[head]
    model = auto.from_config(config).float().eval()
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return path
