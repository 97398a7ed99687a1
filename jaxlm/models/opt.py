"""OPT (facebook/opt-*): learned positions with offset 2, pre- or post-LN, ReLU, biases,
project_in/project_out when word_embed_proj_dim != hidden_size, tied LM head."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from jaxlm.attention.kv_quant import add_kv_scales, kv_scale_args
from jaxlm.core.kv_cache_utils import KVCacheSpec
from jaxlm.models.base import CausalLMBase, DecoderStack
from jaxlm.models.layers import Embedding, LayerNorm, Linear, ParallelStyle, get_act_fn

COLUMN, ROW, REPLICATED = ParallelStyle.COLUMN, ParallelStyle.ROW, ParallelStyle.REPLICATED

# OPT's learned position table starts at index 2 (fairseq's padding offset).
_POSITION_OFFSET = 2


@dataclasses.dataclass(frozen=True)
class OPTArgs:
    vocab_size: int
    hidden_size: int
    ffn_dim: int
    num_layers: int
    num_heads: int
    max_positions: int
    word_embed_proj_dim: int
    do_layer_norm_before: bool
    has_final_layer_norm: bool
    ln_affine: bool
    bias: bool
    act: str
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, c: Any) -> "OPTArgs":
        pre_ln = bool(getattr(c, "do_layer_norm_before", True))
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            ffn_dim=c.ffn_dim,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            max_positions=c.max_position_embeddings,
            word_embed_proj_dim=getattr(c, "word_embed_proj_dim", None) or c.hidden_size,
            do_layer_norm_before=pre_ln,
            has_final_layer_norm=pre_ln and not getattr(c, "_remove_final_layer_norm", False),
            ln_affine=bool(getattr(c, "layer_norm_elementwise_affine", True)),
            bias=bool(getattr(c, "enable_bias", True)),
            act=getattr(c, "activation_function", "relu"),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        )


def _ln(args: OPTArgs, dtype, rngs) -> LayerNorm:
    return LayerNorm(args.hidden_size, eps=1e-5, dtype=dtype, rngs=rngs, affine=args.ln_affine)


class OPTAttention(nnx.Module):
    def __init__(self, args: OPTArgs, *, dtype, attn_backend, rngs: nnx.Rngs):
        h, b = args.hidden_size, args.bias
        self.num_heads = args.num_heads
        self.head_dim = h // args.num_heads
        self.scale = self.head_dim**-0.5
        self.attn_backend = attn_backend
        add_kv_scales(self, attn_backend)  # an fp8 KV cache's k_scale / v_scale
        self.q_proj = Linear(h, h, bias=b, parallel=COLUMN, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, h, bias=b, parallel=COLUMN, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, h, bias=b, parallel=COLUMN, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(h, h, bias=b, parallel=ROW, dtype=dtype, rngs=rngs)

    def __call__(self, x, kv_cache, md):
        T = x.shape[0]
        shape = (T, self.num_heads, self.head_dim)
        q, k, v = self.q_proj(x).reshape(shape), self.k_proj(x).reshape(shape), self.v_proj(x).reshape(shape)
        out, kv_cache = self.attn_backend(q, k, v, kv_cache, md, scale=self.scale, **kv_scale_args(self, k, v, md))
        return self.out_proj(out.reshape(T, -1)), kv_cache


class OPTDecoderLayer(nnx.Module):
    def __init__(self, args: OPTArgs, *, dtype, attn_backend, rngs: nnx.Rngs):
        self.pre_ln = args.do_layer_norm_before
        self.act = args.act
        get_act_fn(self.act)
        self.self_attn = OPTAttention(args, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
        self.self_attn_layer_norm = _ln(args, dtype, rngs)
        self.fc1 = Linear(args.hidden_size, args.ffn_dim, bias=args.bias, parallel=COLUMN, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(args.ffn_dim, args.hidden_size, bias=args.bias, parallel=ROW, dtype=dtype, rngs=rngs)
        self.final_layer_norm = _ln(args, dtype, rngs)

    def __call__(self, x, positions, kv_cache, md):
        h = self.self_attn_layer_norm(x) if self.pre_ln else x
        h, kv_cache = self.self_attn(h, kv_cache, md)
        x = x + h
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_ln else x
        x = x + self.fc2(get_act_fn(self.act)(self.fc1(h)))
        if not self.pre_ln:
            x = self.final_layer_norm(x)
        return x, kv_cache


class OPTDecoder(DecoderStack):
    def __init__(self, args: OPTArgs, *, dtype, attn_backend, rngs: nnx.Rngs):
        h, p = args.hidden_size, args.word_embed_proj_dim
        self.embed_tokens = Embedding(args.vocab_size, p, dtype=dtype, rngs=rngs)
        self.embed_positions = Embedding(
            args.max_positions + _POSITION_OFFSET, h, dtype=dtype, rngs=rngs, shard_vocab=False
        )
        self.project_in = (
            Linear(p, h, bias=False, parallel=REPLICATED, dtype=dtype, rngs=rngs) if p != h else None
        )
        self.project_out = (
            Linear(h, p, bias=False, parallel=REPLICATED, dtype=dtype, rngs=rngs) if p != h else None
        )
        self.final_layer_norm = _ln(args, dtype, rngs) if args.has_final_layer_norm else None
        self.layers = nnx.List(
            [OPTDecoderLayer(args, dtype=dtype, attn_backend=attn_backend, rngs=rngs) for _ in range(args.num_layers)]
        )

    def embed(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions + _POSITION_OFFSET)

    def decoder_layers(self):
        return self.layers

    def final(self, x):
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nnx.Module):
    def __init__(self, args: OPTArgs, *, dtype, attn_backend, rngs: nnx.Rngs):
        self.decoder = OPTDecoder(args, dtype=dtype, attn_backend=attn_backend, rngs=rngs)


class OPTForCausalLM(CausalLMBase):
    @classmethod
    def make_args(cls, config: Any) -> OPTArgs:
        return OPTArgs.from_hf_config(config)

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        self.model = OPTModel(self.args, dtype=self.dtype, attn_backend=self.attn_backend, rngs=rngs)

    def canonical_name(self, name: str) -> str:
        # facebook/opt-* checkpoints predate the "model." prefix.
        return "model." + name if name.startswith("decoder.") else name

    def decoder(self) -> nnx.Module:
        return self.model.decoder

    def input_embedding(self) -> nnx.Module:
        return self.model.decoder.embed_tokens

    @classmethod
    def kv_cache_spec(cls, args: OPTArgs) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=args.num_layers, num_kv_heads=args.num_heads, head_dim=args.hidden_size // args.num_heads
        )
