"""Tiny random HF models (float32, safetensors) for tests, built with transformers, never downloaded.

Each ``make_tiny_*`` builds a config (overridable with keyword arguments), creates the model
with a fixed torch seed, saves it with ``save_pretrained(path, safe_serialization=True)``
and returns ``path``, with a one-token-per-byte tokenizer beside it when the vocabulary holds
one (tests/helpers/tiny_tokenizer.py writes every tokenizer the tests use).

    path = make_tiny_llama(tmp_path / "llama", num_key_value_heads=1)
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers

from tests.helpers.tiny_tokenizer import (
    BOS_ID, BYTE_VOCAB, EOS_ID, PAD_ID, TINY_VOCAB, add_tiny_tokenizer, write_byte_tokenizer,
)

# Shared tiny shape: hidden 64, 2 layers, vocab 320 (the byte tokenizer uses 259 ids).
VOCAB_SIZE = 320

_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    # Larger than HF's 0.02 so attention is peaked and logits spread: mapping bugs show up
    # as large diffs and greedy argmax has clear margins.
    initializer_range=0.1,
)


def _build(
    config: transformers.PretrainedConfig, path: str | os.PathLike, seed: int, with_tokenizer: bool | None
) -> str:
    path = str(path)
    fits = config.vocab_size >= BYTE_VOCAB
    if with_tokenizer and not fits:
        raise ValueError(f"vocab_size {config.vocab_size} too small for the byte tokenizer (needs {BYTE_VOCAB})")
    if with_tokenizer is None:
        with_tokenizer = fits  # default: a tokenizer whenever the vocab can hold one
    torch.manual_seed(seed)
    config.architectures = None  # set by save_pretrained from the class
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.float().eval()
    # Norm weights default to ones and biases to zeros: randomize them so a wrong mapping shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight", "layer_norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        write_byte_tokenizer(path)
    return path


# MoE families with awkward shapes: odd expert counts, top-k > 2, dense layers between sparse
# ones, a shared expert, q/k norms of both kinds.
_TINY_MOE: dict[str, tuple[type, dict[str, Any]]] = {
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=5, num_experts_per_tok=3, intermediate_size=32)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(
        num_experts=7, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        num_experts=9, num_experts_per_tok=4, moe_intermediate_size=32, head_dim=32, num_hidden_layers=3,
        mlp_only_layers=[1], norm_topk_prob=True)),
    "olmoe": (transformers.OlmoeConfig, dict(num_experts=6, num_experts_per_tok=3, intermediate_size=32,
                                             clip_qkv=2.0)),
}


def tiny_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    """The tiny HF config of a family ('llama', 'mistral', 'qwen2', 'qwen3', 'opt', 'gpt2', and the
    MoE families 'mixtral', 'qwen2_moe', 'qwen3_moe', 'olmoe')."""
    if family in _TINY_MOE:
        cls, moe = _TINY_MOE[family]
        return cls(**{**_TINY_COMMON, "rms_norm_eps": 1e-6, **moe, **overrides})
    if family in ("llama", "mistral", "qwen2", "qwen3"):
        kw = dict(_TINY_COMMON, rms_norm_eps=1e-6)
        if family == "mistral":
            kw.update(sliding_window=8)
        if family == "qwen3":
            kw.update(head_dim=32)  # != hidden / heads (16)
        kw.update(overrides)
        cls = {
            "llama": transformers.LlamaConfig,
            "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config,
        }[family]
        return cls(**kw)
    if family == "opt":
        kw = dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
            activation_function="relu",
            tie_word_embeddings=True,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            init_std=0.1,
        )
        kw.update(overrides)
        return transformers.OPTConfig(**kw)
    if family == "gpt2":
        kw = dict(
            vocab_size=VOCAB_SIZE,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            activation_function="gelu_new",
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.1,
        )
        kw.update(overrides)
        return transformers.GPT2Config(**kw)
    raise ValueError(f"unknown family {family!r}")


def make_tiny_model(
    family: str, path: str | os.PathLike, *, seed: int = 0, with_tokenizer: bool | None = None, **overrides: Any
) -> str:
    return _build(tiny_config(family, **overrides), path, seed, with_tokenizer)


def make_tiny_llama(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """Llama, GQA 4:2, untied; e.g. ``tie_word_embeddings=True`` or ``num_key_value_heads=1``."""
    return make_tiny_model("llama", path, seed=seed, **overrides)


def make_tiny_llama3(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """Llama 3.1-style rope scaling with a short original context so the scaling matters."""
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
        rope_theta=500000.0,
    )
    overrides.setdefault("rope_scaling", scaling)
    return make_tiny_model("llama", path, seed=seed, **overrides)


def make_tiny_mistral(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """Mistral with sliding_window=8 (smaller than the tests' sequences)."""
    return make_tiny_model("mistral", path, seed=seed, **overrides)


def make_tiny_qwen2(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    return make_tiny_model("qwen2", path, seed=seed, **overrides)


def make_tiny_qwen3(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """Qwen3 with head_dim 32 != hidden/heads, q/k norms."""
    return make_tiny_model("qwen3", path, seed=seed, **overrides)


def make_tiny_opt(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """OPT, pre-LN, ReLU, tied; ``word_embed_proj_dim=32`` adds project_in/project_out."""
    return make_tiny_model("opt", path, seed=seed, **overrides)


def make_tiny_gpt2(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    return make_tiny_model("gpt2", path, seed=seed, **overrides)


def load_hf_model(path: str | os.PathLike) -> torch.nn.Module:
    """The saved tiny model back in transformers (float32, eval, eager attention)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def make_tiny_engine_model(family: str, path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """A tiny random model of `family` with the trained BPE tokenizer beside it: what LLM(model=path) needs."""
    overrides.setdefault("vocab_size", TINY_VOCAB)
    make_tiny_model(family, path, seed=seed, with_tokenizer=False, **overrides)
    return add_tiny_tokenizer(path)
