"""Gemma 3 (text): Llama's layers configured as Gemma, plus its four-norm decoder layer.

What differs from Llama, each read from the HF config (no per-checkpoint constants):
- embeddings scaled by sqrt(hidden_size), in the model dtype as transformers does;
- every RMSNorm scales by (1 + weight), in float32;
- four norms per layer: ``post_attention_layernorm`` and ``post_feedforward_layernorm`` norm each
  block's output before its residual add, ``pre_feedforward_layernorm`` the MLP's input;
- q/k RMSNorm per head; attention scale ``query_pre_attn_scalar ** -0.5``;
- local layers attend within ``sliding_window`` with their own rope (``rope_local_base_freq``, no
  scaling), global layers use ``rope_theta`` and ``rope_scaling``; which is which comes from
  ``layer_types`` (else every ``sliding_window_pattern``-th layer is global);
- GELU-tanh MLP (``hidden_activation``); ``final_logit_softcapping``; tied embeddings.

``attn_logit_softcapping``: transformers' Gemma 3 attention does not apply it and vLLM passes no
cap for Gemma 3, so it is not applied here either (a warning says so when a config sets it).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from flax import nnx

from jaxlm.models.config_values import config_float
from jaxlm.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM, rms_norm
from jaxlm.models.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config: Any) -> tuple[str, ...]:
    """Per layer: "sliding_attention" (local) or "full_attention" (global)."""
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(types)
    # transformers 4.x configs: every pattern-th layer is global (transformers' default pattern 6).
    pattern = int(getattr(config, "sliding_window_pattern", None) or 6)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers))


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """input norm -> attention -> post-attention norm -> residual add; pre-feedforward norm -> MLP ->
    post-feedforward norm -> residual add."""

    def __init__(self, args: LlamaArgs, layer_idx: int, rope, *, dtype, attn_backend, rngs: nnx.Rngs):
        super().__init__(args, layer_idx, rope, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
        self.pre_feedforward_layernorm = rms_norm(args, args.hidden_size, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = rms_norm(args, args.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + self.post_attention_layernorm(h)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, kv_cache


class Gemma3ForCausalLM(LlamaForCausalLM):
    _qk_norm = True
    decoder_layer_cls = Gemma3DecoderLayer

    @classmethod
    def make_args(cls, config: Any) -> LlamaArgs:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
        window = config_float(config, "sliding_window", positive=True)
        windows = tuple(int(window) if t == SLIDING and window is not None else None for t in layer_types(config))
        return dataclasses.replace(
            super().make_args(config),
            hidden_act=getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh",
            sliding_windows=windows,
            attn_scale=config_float(config, "query_pre_attn_scalar", positive=True) ** -0.5,
            norm_weight_offset=1.0,
            embedding_multiplier=float(config.hidden_size) ** 0.5,
            final_logit_softcap=config_float(config, "final_logit_softcapping", positive=True),
        )

    def layer_ropes(self, config: Any) -> tuple[RotaryEmbedding | None, ...]:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            logger.warning("Gemma 3: attn_logit_softcapping=%s is not applied (transformers' and vLLM's Gemma 3 "
                           "do not apply it either)", config.attn_logit_softcapping)
        return layer_ropes(config, self.args.head_dim, self.max_model_len)


def layer_ropes(config: Any, head_dim: int, max_model_len: int | None = None) -> tuple[RotaryEmbedding, ...]:
    """Per layer: the local rope on sliding layers, the global one on full-attention layers."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and SLIDING in params:  # transformers 5.x: one dict per layer type
        local = RotaryEmbedding.from_config(config, head_dim, layer_type=SLIDING, max_model_len=max_model_len)
        glob = RotaryEmbedding.from_config(config, head_dim, layer_type=FULL, max_model_len=max_model_len)
    else:  # 4.x: rope_theta + rope_scaling are the global layers'; local ones are unscaled
        glob = RotaryEmbedding.from_config(config, head_dim, max_model_len=max_model_len)
        local = RotaryEmbedding(head_dim, float(getattr(config, "rope_local_base_freq", 10000.0)))
    return tuple(local if t == SLIDING else glob for t in layer_types(config))
