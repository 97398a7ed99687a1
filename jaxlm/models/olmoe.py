"""OLMoE: Llama attention whose q/k RMSNorm spans the whole projection (not each head), with
optional ``clip_qkv``; every layer an MoE block, top-k weights renormalised only with
``norm_topk_prob`` (off in the released models)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

from jaxlm.models.llama import LlamaArgs, LlamaAttention, rms_norm
from jaxlm.models.llama_moe import LlamaMoEForCausalLM
from jaxlm.models.moe import MoEArgs


class OlmoeAttention(LlamaAttention):
    def __init__(self, args: LlamaArgs, layer_idx: int, rope, *, dtype, attn_backend, rngs: nnx.Rngs,
                 clip_qkv: float | None = None):
        super().__init__(args, layer_idx, rope, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
        d = args.head_dim
        # Llama left these None (static); nnx.data makes them sub-modules.
        self.q_norm = nnx.data(rms_norm(args, args.num_heads * d, dtype=dtype, rngs=rngs))
        self.k_norm = nnx.data(rms_norm(args, args.num_kv_heads * d, dtype=dtype, rngs=rngs))
        if args.kv_repeat > 1:
            # KV heads repeated for tensor parallel: the norm's weight repeats with them (its
            # mean over the repeated projection is the checkpoint's mean).
            self.k_norm.weight.set_metadata("kv_repeat", (args.kv_repeat, d))
        self.clip_qkv = None if clip_qkv is None else float(clip_qkv)

    def project_qkv(self, x):
        T = x.shape[0]
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return (q.reshape(T, self.num_heads, self.head_dim), k.reshape(T, self.num_kv_heads, self.head_dim),
                v.reshape(T, self.num_kv_heads, self.head_dim))


class OlmoeForCausalLM(LlamaMoEForCausalLM):
    @classmethod
    def moe_args(cls, config: Any) -> MoEArgs:
        return MoEArgs.from_hf_config(config, num_experts=config.num_experts,
                                      intermediate_size=config.intermediate_size,
                                      renormalize=bool(getattr(config, "norm_topk_prob", False)))

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        self.clip_qkv = getattr(config, "clip_qkv", None)
        super().build(config, rngs)

    def attention_cls(self) -> Callable[..., nnx.Module]:
        return functools.partial(OlmoeAttention, clip_qkv=self.clip_qkv)
