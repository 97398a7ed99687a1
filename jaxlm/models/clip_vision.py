"""CLIP's vision transformer (HF ``CLIPVisionModel``), the image encoder of LLaVA; its blocks
are SigLIP's too (siglip_vision.py).

Patches (a stride-p convolution, done as one matmul over flattened patches) + a class token +
learned position embeddings, a pre-LayerNorm, then pre-norm blocks of bidirectional attention
and an MLP. ``__call__`` returns the hidden states after the embeddings and after each block,
as HF's ``output_hidden_states``: LLaVA picks one (or several) of them, not the last output.

Every layer is replicated under tensor parallel (the tower is small next to the decoder and runs
once per image) and is never quantized: it is built with ``quantizable=False``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.layers import Embedding, LayerNorm, Linear, ParallelStyle, get_act_fn
from jaxlm.models.utils import make_param

REPLICATED = ParallelStyle.REPLICATED


@dataclasses.dataclass(frozen=True)
class CLIPVisionArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf_config(cls, c: Any) -> "CLIPVisionArgs":
        return cls(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, image_size=c.image_size,
                   patch_size=c.patch_size, num_channels=getattr(c, "num_channels", 3),
                   layer_norm_eps=float(getattr(c, "layer_norm_eps", 1e-5)),
                   hidden_act=getattr(c, "hidden_act", "quick_gelu"))


def _linear(i: int, o: int, *, dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(i, o, bias=True, parallel=REPLICATED, dtype=dtype, rngs=rngs, quantizable=False)


def patch_embed(pixel_values: jax.Array, weight: jax.Array, p: int) -> jax.Array:
    """HF's stride-p Conv2d (weight [D, C, p, p]) over [N, C, H, W] as one matmul over the
    flattened patches, row-major over the patch grid: [N, (H/p) * (W/p), D]."""
    n, c, h, w = pixel_values.shape
    patches = pixel_values.reshape(n, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(n, (h // p) * (w // p), c * p * p)
    return patches.astype(weight.dtype) @ weight.reshape(weight.shape[0], -1).T


class CLIPVisionEmbeddings(nnx.Module):
    def __init__(self, a: CLIPVisionArgs, *, dtype, rngs: nnx.Rngs):
        d, p = a.hidden_size, a.patch_size
        self.patch_size = p
        self.class_embedding = make_param(rngs, (d,), dtype, (None,))
        # HF's Conv2d weight [out, in, p, p], kept as is and flattened at use.
        self.patch_embedding = nnx.Module()
        self.patch_embedding.weight = make_param(rngs, (d, a.num_channels, p, p), dtype, (None,) * 4)
        self.position_embedding = Embedding(a.num_patches + 1, d, dtype=dtype, rngs=rngs, shard_vocab=False)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """[N, C, H, W] -> [N, 1 + patches, D]."""
        x = patch_embed(pixel_values, self.patch_embedding.weight[...], self.patch_size)
        cls = jnp.broadcast_to(self.class_embedding[...], (pixel_values.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1)
        return x + self.position_embedding(jnp.arange(x.shape[1]))[None]


class CLIPAttention(nnx.Module):
    def __init__(self, a: CLIPVisionArgs, *, dtype, rngs: nnx.Rngs):
        d = a.hidden_size
        self.num_heads, self.head_dim = a.num_heads, d // a.num_heads
        self.q_proj, self.k_proj = _linear(d, d, dtype=dtype, rngs=rngs), _linear(d, d, dtype=dtype, rngs=rngs)
        self.v_proj, self.out_proj = _linear(d, d, dtype=dtype, rngs=rngs), _linear(d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        n, t, d = x.shape
        split = lambda y: y.reshape(n, t, self.num_heads, self.head_dim)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * self.head_dim**-0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.out_proj(jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, t, d))


class CLIPMLP(nnx.Module):
    def __init__(self, a: CLIPVisionArgs, *, dtype, rngs: nnx.Rngs):
        self.act = a.hidden_act
        get_act_fn(self.act)  # fail at construction
        self.fc1 = _linear(a.hidden_size, a.intermediate_size, dtype=dtype, rngs=rngs)
        self.fc2 = _linear(a.intermediate_size, a.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(get_act_fn(self.act)(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, a: CLIPVisionArgs, *, dtype, rngs: nnx.Rngs):
        self.self_attn = CLIPAttention(a, dtype=dtype, rngs=rngs)
        self.layer_norm1 = LayerNorm(a.hidden_size, eps=a.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = CLIPMLP(a, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(a.hidden_size, eps=a.layer_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionModel(nnx.Module):
    """Under HF's names: ``embeddings``, ``pre_layrnorm`` (sic), ``encoder.layers.i``, ``post_layernorm``."""

    def __init__(self, a: CLIPVisionArgs, *, dtype, rngs: nnx.Rngs):
        self.embeddings = CLIPVisionEmbeddings(a, dtype=dtype, rngs=rngs)
        self.pre_layrnorm = LayerNorm(a.hidden_size, eps=a.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.encoder = nnx.Module()
        self.encoder.layers = nnx.List([CLIPEncoderLayer(a, dtype=dtype, rngs=rngs) for _ in range(a.num_layers)])
        # Loaded (it is in every checkpoint) but LLaVA reads no state past it.
        self.post_layernorm = LayerNorm(a.hidden_size, eps=a.layer_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, pixel_values: jax.Array, num_layers: int) -> list[jax.Array]:
        """HF's hidden_states[0..num_layers]: after the embeddings, then after each of the first
        ``num_layers`` blocks (the later ones are not run)."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers[:num_layers]:
            x = layer(x)
            states.append(x)
        return states
