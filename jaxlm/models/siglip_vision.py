"""SigLIP's vision transformer (HF ``SiglipVisionModel``), the image encoder of Gemma 3.

What is SigLIP's own beside CLIP (clip_vision.py, whose blocks it uses: the same pre-norm
attention + MLP under the same names): the patch convolution has a bias, there is no class
token and no pre-norm, and the output is the last block's state after ``post_layernorm``.
The attention-pooling ``head`` (``vision_use_head``) is not built: Gemma 3 reads the patch
states (its published configs set no head; a checkpoint's head weights are skipped). Replicated under tensor parallel, never quantized.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxlm.models.clip_vision import CLIPEncoderLayer, CLIPVisionArgs, patch_embed
from jaxlm.models.layers import Embedding, LayerNorm
from jaxlm.models.utils import make_param


class SiglipVisionEmbeddings(nnx.Module):
    def __init__(self, a: CLIPVisionArgs, *, dtype, rngs: nnx.Rngs):
        d, p = a.hidden_size, a.patch_size
        self.patch_size = p
        self.patch_embedding = nnx.Module()  # HF's Conv2d: weight [out, in, p, p] and a bias
        self.patch_embedding.weight = make_param(rngs, (d, a.num_channels, p, p), dtype, (None,) * 4)
        self.patch_embedding.bias = make_param(rngs, (d,), dtype, (None,), init="zeros")
        self.position_embedding = Embedding(a.num_patches, d, dtype=dtype, rngs=rngs, shard_vocab=False)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """[N, C, H, W] -> [N, patches, D]."""
        x = patch_embed(pixel_values, self.patch_embedding.weight[...], self.patch_size)
        x = x + self.patch_embedding.bias[...]
        return x + self.position_embedding(jax.numpy.arange(x.shape[1]))[None]


class SiglipVisionModel(nnx.Module):
    """Under HF's names: ``embeddings``, ``encoder.layers.i``, ``post_layernorm``."""

    def __init__(self, a: CLIPVisionArgs, *, dtype, rngs: nnx.Rngs):
        if a.image_size % a.patch_size:
            raise ValueError(f"SigLIP: image_size {a.image_size} is not a multiple of patch_size {a.patch_size}")
        self.embeddings = SiglipVisionEmbeddings(a, dtype=dtype, rngs=rngs)
        self.encoder = nnx.Module()
        self.encoder.layers = nnx.List([CLIPEncoderLayer(a, dtype=dtype, rngs=rngs) for _ in range(a.num_layers)])
        self.post_layernorm = LayerNorm(a.hidden_size, eps=a.layer_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """[N, C, H, W] -> HF's last_hidden_state [N, patches, D]."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
