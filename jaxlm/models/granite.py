"""IBM Granite 3.x: Llama with four multipliers from the config.

``embedding_multiplier`` scales the embeddings, ``attention_multiplier`` is the attention scale
(in place of head_dim ** -0.5), ``residual_multiplier`` scales each block's output before its
residual add, and the logits are divided by ``logits_scaling``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from jaxlm.models.config_values import config_float
from jaxlm.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, args: LlamaArgs, layer_idx: int, rope, *, dtype, attn_backend, rngs: nnx.Rngs):
        super().__init__(args, layer_idx, rope, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
        self.residual_multiplier = float(args.residual_multiplier)

    def __call__(self, x, positions, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + h * self.residual_multiplier
        x = x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier
        return x, kv_cache


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GraniteDecoderLayer

    @classmethod
    def make_args(cls, config: Any) -> LlamaArgs:
        return dataclasses.replace(
            super().make_args(config),
            attn_scale=config_float(config, "attention_multiplier", 1.0, positive=True),
            embedding_multiplier=config_float(config, "embedding_multiplier", 1.0, positive=True),
            residual_multiplier=config_float(config, "residual_multiplier", 1.0, positive=True),
            logits_scaling=config_float(config, "logits_scaling", 1.0, positive=True),
        )
