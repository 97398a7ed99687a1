"""GPT-2: Conv1D weights already [in, out], fused c_attn, learned positions, gelu_new, ln_f.

The fused c_attn tensor is split into q/k/v Params at load time so each one can carry a
column-parallel spec of its own (a column split of the fused [q|k|v] would mix q, k and v).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from jaxlm.attention.kv_quant import add_kv_scales, kv_scale_args
from jaxlm.core.kv_cache_utils import KVCacheSpec
from jaxlm.models.base import CausalLMBase, DecoderStack, WeightTarget
from jaxlm.models.layers import Embedding, LayerNorm, Linear, ParallelStyle, get_act_fn
from jaxlm.models.utils import HF_AS_IS

COLUMN, ROW = ParallelStyle.COLUMN, ParallelStyle.ROW


@dataclasses.dataclass(frozen=True)
class GPT2Args:
    vocab_size: int
    hidden_size: int
    inner_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    eps: float
    act: str
    scale_attn_weights: bool
    scale_by_inverse_layer_idx: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, c: Any) -> "GPT2Args":
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.n_embd,
            inner_size=getattr(c, "n_inner", None) or 4 * c.n_embd,
            num_layers=c.n_layer,
            num_heads=c.n_head,
            max_positions=c.n_positions,
            eps=float(c.layer_norm_epsilon),
            act=getattr(c, "activation_function", "gelu_new"),
            scale_attn_weights=bool(getattr(c, "scale_attn_weights", True)),
            scale_by_inverse_layer_idx=bool(getattr(c, "scale_attn_by_inverse_layer_idx", False)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        )


def _conv1d(n_in: int, n_out: int, parallel: ParallelStyle, dtype, rngs) -> Linear:
    # HF Conv1D stores [in, out] already: no transpose at load.
    return Linear(n_in, n_out, bias=True, parallel=parallel, dtype=dtype, rngs=rngs, hf_layout=HF_AS_IS)


class GPT2Attention(nnx.Module):
    def __init__(self, args: GPT2Args, layer_idx: int, *, dtype, attn_backend, rngs: nnx.Rngs):
        h = args.hidden_size
        self.num_heads = args.num_heads
        self.head_dim = h // args.num_heads
        scale = self.head_dim**-0.5 if args.scale_attn_weights else 1.0
        if args.scale_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.scale = scale
        self.attn_backend = attn_backend
        add_kv_scales(self, attn_backend)  # an fp8 KV cache's k_scale / v_scale
        # Filled from the fused checkpoint tensor c_attn (see GPT2LMHeadModel._extra_targets).
        self.q_proj = _conv1d(h, h, COLUMN, dtype, rngs)
        self.k_proj = _conv1d(h, h, COLUMN, dtype, rngs)
        self.v_proj = _conv1d(h, h, COLUMN, dtype, rngs)
        self.c_proj = _conv1d(h, h, ROW, dtype, rngs)

    def __call__(self, x, kv_cache, md):
        T = x.shape[0]
        shape = (T, self.num_heads, self.head_dim)
        q, k, v = self.q_proj(x).reshape(shape), self.k_proj(x).reshape(shape), self.v_proj(x).reshape(shape)
        out, kv_cache = self.attn_backend(q, k, v, kv_cache, md, scale=self.scale, **kv_scale_args(self, k, v, md))
        return self.c_proj(out.reshape(T, -1)), kv_cache


class GPT2MLP(nnx.Module):
    def __init__(self, args: GPT2Args, *, dtype, rngs: nnx.Rngs):
        self.act = args.act
        get_act_fn(self.act)
        self.c_fc = _conv1d(args.hidden_size, args.inner_size, COLUMN, dtype, rngs)
        self.c_proj = _conv1d(args.inner_size, args.hidden_size, ROW, dtype, rngs)

    def __call__(self, x):
        return self.c_proj(get_act_fn(self.act)(self.c_fc(x)))


class GPT2Block(nnx.Module):
    def __init__(self, args: GPT2Args, layer_idx: int, *, dtype, attn_backend, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(args.hidden_size, eps=args.eps, dtype=dtype, rngs=rngs)
        self.attn = GPT2Attention(args, layer_idx, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
        self.ln_2 = LayerNorm(args.hidden_size, eps=args.eps, dtype=dtype, rngs=rngs)
        self.mlp = GPT2MLP(args, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, md):
        h, kv_cache = self.attn(self.ln_1(x), kv_cache, md)
        x = x + h
        return x + self.mlp(self.ln_2(x)), kv_cache


class GPT2Model(DecoderStack):
    def __init__(self, args: GPT2Args, *, dtype, attn_backend, rngs: nnx.Rngs):
        self.wte = Embedding(args.vocab_size, args.hidden_size, dtype=dtype, rngs=rngs)
        self.wpe = Embedding(args.max_positions, args.hidden_size, dtype=dtype, rngs=rngs, shard_vocab=False)
        self.h = nnx.List(
            [GPT2Block(args, i, dtype=dtype, attn_backend=attn_backend, rngs=rngs) for i in range(args.num_layers)]
        )
        self.ln_f = LayerNorm(args.hidden_size, eps=args.eps, dtype=dtype, rngs=rngs)

    def embed(self, input_ids, positions):
        return self.wte(input_ids) + self.wpe(positions)

    def decoder_layers(self):
        return self.h

    def final(self, x):
        return self.ln_f(x)


class GPT2LMHeadModel(CausalLMBase):
    _ignored_suffixes = (".attn.bias", ".attn.masked_bias")
    # HF's fused c_attn is our q/k/v (vLLM's name): an adapter on c_attn is split over them.
    packed_modules_mapping = {"c_attn": ("q_proj", "k_proj", "v_proj")}

    @classmethod
    def make_args(cls, config: Any) -> GPT2Args:
        return GPT2Args.from_hf_config(config)

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        self.transformer = GPT2Model(self.args, dtype=self.dtype, attn_backend=self.attn_backend, rngs=rngs)

    def canonical_name(self, name: str) -> str:
        # openai-community/gpt2 stores names without the "transformer." prefix.
        if name.startswith(("transformer.", "lm_head.")):
            return name
        return "transformer." + name

    def _skip_by_path(self, name: str) -> bool:
        return any(f".attn.{p}_proj." in name for p in "qkv")

    def _extra_targets(self) -> dict[str, WeightTarget]:
        n = self.args.hidden_size
        targets = {}
        for i, block in enumerate(self.transformer.h):
            a = block.attn
            parts = [(a.q_proj, 0), (a.k_proj, 1), (a.v_proj, 2)]
            targets[f"transformer.h.{i}.attn.c_attn.weight"] = WeightTarget(
                (n, 3 * n), [(lin.weight, _cols(j, n)) for lin, j in parts]
            )
            targets[f"transformer.h.{i}.attn.c_attn.bias"] = WeightTarget(
                (3 * n,), [(lin.bias, _cols(j, n)) for lin, j in parts]
            )
        return targets

    def decoder(self) -> nnx.Module:
        return self.transformer

    def input_embedding(self) -> nnx.Module:
        return self.transformer.wte

    @classmethod
    def kv_cache_spec(cls, args: GPT2Args) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=args.num_layers, num_kv_heads=args.num_heads, head_dim=args.hidden_size // args.num_heads
        )


def _cols(j: int, n: int):
    """Slice j of a fused [.., 3n] tensor along its last axis."""
    return lambda a: a[..., j * n : (j + 1) * n]
