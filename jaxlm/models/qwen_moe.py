"""Qwen2-MoE and Qwen3-MoE: the Qwen attention (q/k/v biases; Qwen3: per-head q/k RMSNorm and
an explicit head_dim) with MoE blocks on the sparse layers (``decoder_sparse_step``,
``mlp_only_layers``) and the dense MLP between them. Top-k weights renormalised only with
``norm_topk_prob``; Qwen2-MoE adds a shared expert behind a sigmoid gate."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlm.models.llama import LlamaArgs
from jaxlm.models.llama_moe import LlamaMoEForCausalLM
from jaxlm.models.moe import MoEArgs


class Qwen2MoeForCausalLM(LlamaMoEForCausalLM):
    @classmethod
    def make_args(cls, config: Any) -> LlamaArgs:
        # Qwen2-MoE's config names the q/k/v bias ``qkv_bias`` (o_proj has none).
        return dataclasses.replace(super().make_args(config), qkv_bias=bool(getattr(config, "qkv_bias", True)))

    @classmethod
    def moe_args(cls, config: Any) -> MoEArgs:
        return MoEArgs.from_hf_config(
            config, num_experts=config.num_experts, intermediate_size=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0))


class Qwen3MoeForCausalLM(LlamaMoEForCausalLM):
    _qk_norm = True

    @classmethod
    def moe_args(cls, config: Any) -> MoEArgs:
        return MoEArgs.from_hf_config(config, num_experts=config.num_experts,
                                      intermediate_size=config.moe_intermediate_size,
                                      renormalize=bool(getattr(config, "norm_topk_prob", False)))
