"""Tiny random HF models (float32, safetensors) for tests, built with transformers, never downloaded.

Each ``make_tiny_*`` builds a config (overridable with keyword arguments), creates the model
with a fixed torch seed, saves it with ``save_pretrained(path, safe_serialization=True)``
and returns ``path``, with a one-token-per-byte tokenizer beside it when the vocabulary holds
one (tests/helpers/tiny_tokenizer.py writes every tokenizer the tests use).

    path = make_tiny_llama(tmp_path / "llama", num_key_value_heads=1)
"""

from __future__ import annotations

import copy
import json
import os
import shutil
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
    fits = config.get_text_config().vocab_size >= BYTE_VOCAB
    if with_tokenizer and not fits:
        raise ValueError(f"vocab_size {config.get_text_config().vocab_size} too small for the byte tokenizer (needs {BYTE_VOCAB})")
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


# Families that differ from Llama in a few places, each with its differences switched on and
# shaped awkwardly: family -> (config class, fields beside _TINY_COMMON).
_DENSE_FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    # 3 local layers per global one, a window shorter than the prompts, head_dim 32 != 64 / 4,
    # an attention scale from query_pre_attn_scalar != head_dim, local and global ropes that
    # differ (global one linearly scaled), final logit soft-capping that bites; tied.
    # attn_logit_softcapping is set although transformers' Gemma 3 ignores it.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        head_dim=32, num_hidden_layers=5, sliding_window=4, sliding_window_pattern=4, query_pre_attn_scalar=24,
        rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling=dict(rope_type="linear", factor=2.0),
        final_logit_softcapping=3.0, attn_logit_softcapping=2.0, tie_word_embeddings=True)),
    # Rope on half of each 16-wide head; longrope with a 16-token original context (factors
    # differ per frequency); GQA 4:2.
    "phi3": (transformers.Phi3Config, dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=16,
        rope_scaling=dict(type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0], long_factor=[1.0, 3.0, 6.0, 12.0]))),
    # Layers 1 and 3 without rope.
    "smollm3": (transformers.SmolLM3Config, dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                                 tie_word_embeddings=True)),
    # All four multipliers != 1 (attention 0.2 != 16 ** -0.5).
    "granite": (transformers.GraniteConfig, dict(embedding_multiplier=3.0, attention_multiplier=0.2,
                                                 residual_multiplier=0.5, logits_scaling=2.5)),
}


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
    """The tiny HF config of a family ('llama', 'mistral', 'qwen2', 'qwen3', 'opt', 'gpt2', the
    dense families of _DENSE_FAMILIES: 'gemma3', 'phi3', 'smollm3', 'granite', and the MoE families
    of _TINY_MOE: 'mixtral', 'qwen2_moe', 'qwen3_moe', 'olmoe')."""
    if family in _TINY_MOE:
        cls, moe = _TINY_MOE[family]
        return cls(**{**_TINY_COMMON, "rms_norm_eps": 1e-6, **copy.deepcopy(moe), **overrides})
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
    if family == "gemma3_mm":  # Gemma 3's multimodal layout (4B and up): the tiny gemma3 + a vision tower
        text = {k: v for k, v in tiny_config("gemma3").to_dict().items() if k in _DENSE_FAMILIES["gemma3"][1]
                or k in _TINY_COMMON or k in ("rope_parameters", "layer_types", "rms_norm_eps")}
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        kw = dict(text_config=text, vision_config=vision, mm_tokens_per_image=4, initializer_range=0.1)
        kw.update(overrides)
        return transformers.Gemma3Config(**kw)
    if family in _DENSE_FAMILIES:
        cls, extra = _DENSE_FAMILIES[family]
        kw = dict(_TINY_COMMON, rms_norm_eps=1e-6, **copy.deepcopy(extra))  # configs keep the dicts given
        kw.update(overrides)
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


def copy_without_chat_template(src: str | os.PathLike, dest: str | os.PathLike) -> str:
    """A copy of a tiny engine model whose tokenizer has no chat template, as a base model's."""
    shutil.copytree(src, dest)
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(dest, name)):
            os.remove(os.path.join(dest, name))
    config_path = os.path.join(dest, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(dest)
