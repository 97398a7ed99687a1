"""Llama and the families built the same way: Mistral, Qwen2, Qwen3 (one implementation, flags).

- Llama 2/3/3.1 (``rope_scaling`` llama3), SmolLM2, TinyLlama: optional attention/mlp biases.
- Mistral: sliding-window attention.
- Qwen2: q/k/v biases (o_proj none), optional sliding window on the upper layers.
- Qwen3: per-head RMSNorm on q and k before rope, explicit head_dim.
GQA/MQA through num_key_value_heads; any head_dim; tied or untied embeddings.

Other dense families are configuration of these layers (the Args' family fields, a rope per
layer, a decoder-layer class) plus a module of what is their own: gemma3.py, phi3.py,
smollm3.py, granite.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.attention.kv_quant import add_kv_scales, kv_scale_args
from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.core.kv_cache_utils import KVCacheSpec
from jaxlm.models.base import CausalLMBase, DecoderStack
from jaxlm.models.layers import Embedding, Linear, ParallelStyle, RMSNorm, get_act_fn
from jaxlm.models.rotary import RotaryEmbedding

COLUMN, ROW = ParallelStyle.COLUMN, ParallelStyle.ROW

@dataclasses.dataclass(frozen=True)
class LlamaArgs:
    """The numbers of an HF config the model needs (hashable; the HF config object is not)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    # Per layer: window size or None (full attention).
    sliding_windows: tuple[int | None, ...]
    # Each checkpoint KV head is held this many times (tensor parallel > KV heads; see for_tensor_parallel).
    kv_repeat: int = 1
    # Family variations; Llama's values by default, set by the families' make_args.
    attn_scale: float | None = None  # None: head_dim ** -0.5
    norm_weight_offset: float = 0.0  # Gemma: every RMSNorm scales by (1 + weight)
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size); Granite: embedding_multiplier
    residual_multiplier: float = 1.0  # Granite: each block's output scaled before the residual add
    logits_scaling: float = 1.0  # Granite: logits divided by it
    final_logit_softcap: float | None = None  # Gemma: cap * tanh(logits / cap)

    def for_tensor_parallel(self, tp: int) -> "LlamaArgs":
        """With more devices than KV heads, each device needs its own copy of the KV head its
        query heads read: the KV heads are repeated up to ``tp`` (tp a multiple of them)."""
        if tp <= self.num_kv_heads:
            return self
        return dataclasses.replace(self, num_kv_heads=tp, kv_repeat=tp // self.num_kv_heads)

    @classmethod
    def from_hf_config(cls, config: Any, *, force_qkv_bias: bool = False, qk_norm: bool = False) -> "LlamaArgs":
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        n_layers = config.num_hidden_layers
        attention_bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if window is None:
            windows = (None,) * n_layers
        elif layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (window,) * n_layers  # Mistral: every layer
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            intermediate_size=config.intermediate_size,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            hidden_act=getattr(config, "hidden_act", "silu"),
            qkv_bias=force_qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=windows,
        )


def rms_norm(args: LlamaArgs, dim: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(dim, eps=args.rms_norm_eps, dtype=dtype, rngs=rngs, weight_offset=args.norm_weight_offset)


class LlamaAttention(nnx.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int, rope: RotaryEmbedding | None, *, dtype, attn_backend,
                 rngs: nnx.Rngs):
        h, d = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, d
        self.scale = d**-0.5 if args.attn_scale is None else float(args.attn_scale)
        self.sliding_window = args.sliding_windows[layer_idx]
        self.rotary_emb = rope
        self.attn_backend = attn_backend
        add_kv_scales(self, attn_backend)  # an fp8 KV cache's k_scale / v_scale
        self.q_proj = Linear(h, args.num_heads * d, bias=args.qkv_bias, parallel=COLUMN, dtype=dtype, rngs=rngs)
        repeat = (args.kv_repeat, d) if args.kv_repeat > 1 else None
        self.k_proj = Linear(h, args.num_kv_heads * d, bias=args.qkv_bias, parallel=COLUMN, dtype=dtype, rngs=rngs,
                             kv_repeat=repeat)
        self.v_proj = Linear(h, args.num_kv_heads * d, bias=args.qkv_bias, parallel=COLUMN, dtype=dtype, rngs=rngs,
                             kv_repeat=repeat)
        self.o_proj = Linear(args.num_heads * d, h, bias=args.o_bias, parallel=ROW, dtype=dtype, rngs=rngs)
        if args.qk_norm:
            self.q_norm = rms_norm(args, d, dtype=dtype, rngs=rngs)
            self.k_norm = rms_norm(args, d, dtype=dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x):
        """q [T, heads, D], k and v [T, KV heads, D], before rope (OLMoE overrides the norms)."""
        T = x.shape[0]
        q = self.q_proj(x).reshape(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def __call__(self, x, positions, kv_cache, md: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.project_qkv(x)
        if self.rotary_emb is not None:  # None: a layer without rope (SmolLM3)
            q, k = self.rotary_emb(positions, q, k)
        out, kv_cache = self.attn_backend(q, k, v, kv_cache, md, scale=self.scale, sliding_window=self.sliding_window,
                                          **kv_scale_args(self, k, v, md))
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim)), kv_cache


class LlamaMLP(nnx.Module):
    def __init__(self, args: LlamaArgs, *, dtype, rngs: nnx.Rngs):
        h, i, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.act = args.hidden_act
        get_act_fn(self.act)  # fail at construction, not at the first step
        self.gate_proj = Linear(h, i, bias=b, parallel=COLUMN, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, bias=b, parallel=COLUMN, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, bias=b, parallel=ROW, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(get_act_fn(self.act)(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm attention + MLP. A family may hand in its own attention or MLP module (OLMoE's
    attention, the MoE block): one decoder layer for every Llama-like family."""

    def __init__(self, args: LlamaArgs, layer_idx: int, rope, *, dtype, attn_backend, rngs: nnx.Rngs,
                 self_attn: nnx.Module | None = None, mlp: nnx.Module | None = None):
        if self_attn is None:
            self_attn = LlamaAttention(args, layer_idx, rope, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
        self.self_attn = self_attn
        self.mlp = LlamaMLP(args, dtype=dtype, rngs=rngs) if mlp is None else mlp
        self.input_layernorm = rms_norm(args, args.hidden_size, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = rms_norm(args, args.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv_cache


class LlamaModel(DecoderStack):
    """``rope``: one RotaryEmbedding for every layer, or one per layer (None: no rope there)."""

    def __init__(self, args: LlamaArgs, rope, *, dtype, attn_backend, rngs: nnx.Rngs,
                 layer_cls: Callable[..., nnx.Module] = LlamaDecoderLayer):
        ropes = rope if isinstance(rope, Sequence) else (rope,) * args.num_layers
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [
                layer_cls(args, i, ropes[i], dtype=dtype, attn_backend=attn_backend, rngs=rngs)
                for i in range(args.num_layers)
            ]
        )
        self.norm = rms_norm(args, args.hidden_size, dtype=dtype, rngs=rngs)
        self.embedding_multiplier = float(args.embedding_multiplier)

    def embed(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * jnp.asarray(self.embedding_multiplier, x.dtype)  # in the model dtype, as HF
        return x

    def decoder_layers(self):
        return self.layers

    def final(self, x):
        return self.norm(x)


class LlamaForCausalLM(CausalLMBase):
    # Family flags, overridden by the subclasses below and in the families' modules.
    _force_qkv_bias = False
    _qk_norm = False
    decoder_layer_cls: type = LlamaDecoderLayer

    @classmethod
    def make_args(cls, config: Any) -> LlamaArgs:
        return LlamaArgs.from_hf_config(config, force_qkv_bias=cls._force_qkv_bias, qk_norm=cls._qk_norm)

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        self.model = LlamaModel(self.args, self.layer_ropes(config), dtype=self.dtype,
                                attn_backend=self.attn_backend, rngs=rngs, layer_cls=self.decoder_layer_cls)

    def layer_ropes(self, config: Any) -> tuple[RotaryEmbedding | None, ...]:
        """The rope of each layer (None: the layer has none)."""
        rope = RotaryEmbedding.from_config(config, self.args.head_dim, max_model_len=self.max_model_len)
        return (rope,) * self.args.num_layers

    def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
        logits = super().compute_logits(hidden_states)
        if self.args.logits_scaling != 1.0:
            logits = logits / self.args.logits_scaling
        cap = self.args.final_logit_softcap
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def decoder(self) -> nnx.Module:
        return self.model

    def input_embedding(self) -> nnx.Module:
        return self.model.embed_tokens

    @classmethod
    def args_for_tensor_parallel(cls, args: LlamaArgs, tp: int) -> LlamaArgs:
        return args.for_tensor_parallel(tp)

    @classmethod
    def kv_cache_spec(cls, args: LlamaArgs) -> KVCacheSpec:
        return KVCacheSpec(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    _force_qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    _qk_norm = True
