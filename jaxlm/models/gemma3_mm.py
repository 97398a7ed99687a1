"""Gemma 3 with images (HF ``Gemma3ForConditionalGeneration``): a SigLIP vision tower, Gemma 3's
projector and the Gemma 3 decoder (gemma3.py), which takes the projected rows in place of the
image's soft-token placeholders.

What is Gemma 3's own, read from the config:
- the projector (``Gemma3MultiModalProjector``): the tower's patch grid average-pooled to
  ``mm_tokens_per_image`` soft tokens (a square grid), Gemma's RMSNorm (1 + weight, the vision
  ``layer_norm_eps``), then ``x @ mm_input_projection_weight`` ([vision hidden, text hidden]);
- bidirectional attention among one image's tokens during prefill, as transformers' mask
  (``token_type_ids``: a query inside a run of image tokens also sees the later tokens of its
  run; the sliding layers keep their window, which does not bound the run's later keys). Here
  each step's runs come from ``mm_mask`` (the placeholder tokens the step fills) and become a
  per-token key limit, ``AttentionMetadata.attn_limits`` (attention/xla_tiles.py). A run must
  be prefilled in one step: the engine sets ``disable_chunked_mm_input`` for this model
  (``bidirectional_mm_items``), so the scheduler never ends a chunk inside an image.

Checkpoint names: transformers saves ``language_model.model.*`` (5.x: ``model.language_model.*``),
``vision_tower.*`` (older: ``vision_tower.vision_model.*``) and ``multi_modal_projector.*``;
``canonical_name`` maps each onto this module tree (the text model under ``model.``, as
Gemma3ForCausalLM). ``final_logit_softcapping`` is not applied: transformers'
Gemma3ForConditionalGeneration applies none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxlm.models.base import check_cache_layout, run_decoder_layers
from jaxlm.models.clip_vision import CLIPVisionArgs
from jaxlm.models.gemma3 import Gemma3ForCausalLM
from jaxlm.models.layers import RMSNorm
from jaxlm.models.llama import LlamaArgs
from jaxlm.models.registry import text_model_config
from jaxlm.models.siglip_vision import SiglipVisionModel
from jaxlm.models.vision_language import VisionLanguageMixin, merge_image_rows
from jaxlm.models.utils import make_param


class Gemma3MultiModalProjector(nnx.Module):
    def __init__(self, vision: CLIPVisionArgs, text_hidden: int, tokens_per_image: int, *, dtype, rngs: nnx.Rngs):
        self.patches_per_side = vision.image_size // vision.patch_size
        side = int(round(tokens_per_image ** 0.5))
        if side * side != tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"Gemma 3: mm_tokens_per_image {tokens_per_image} must be a square whose side divides "
                             f"the {self.patches_per_side}x{self.patches_per_side} patch grid")
        self.kernel = self.patches_per_side // side
        self.mm_input_projection_weight = make_param(rngs, (vision.hidden_size, text_hidden), dtype, (None, None))
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, eps=vision.layer_norm_eps, dtype=dtype, rngs=rngs,
                                        weight_offset=1.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[N, patches, Dv] -> [N, tokens_per_image, D]: HF's AvgPool2d over the row-major grid."""
        n, _, d = x.shape
        p, k = self.patches_per_side, self.kernel
        pooled = x.reshape(n, p // k, k, p // k, k, d).mean(axis=(2, 4), dtype=jnp.float32).astype(x.dtype)
        pooled = self.mm_soft_emb_norm(pooled.reshape(n, -1, d))
        return pooled @ self.mm_input_projection_weight[...].astype(pooled.dtype)


def image_attention_limits(mm_mask: jax.Array, positions: jax.Array, token_to_req: jax.Array) -> jax.Array:
    """[T] the last key position each token may attend to: a token of a run of image tokens (of
    one row) sees up to the run's last position, every other token up to its own (causal).
    transformers' blockwise mask: consecutive image tokens are one block."""
    T = mm_mask.shape[0]
    img = mm_mask != 0
    idx = jnp.arange(T, dtype=jnp.int32)
    cont = jnp.concatenate([img[1:] & (token_to_req[1:] == token_to_req[:-1]), jnp.zeros((1,), bool)])
    run_end = lax.cummin(jnp.where(img & ~cont, idx, T), reverse=True)
    return jnp.where(img, positions + run_end - idx, positions).astype(jnp.int32)


class Gemma3ForConditionalGeneration(VisionLanguageMixin, Gemma3ForCausalLM):
    # An image's tokens attend to each other: each image is prefilled in one step.
    bidirectional_mm_items = True
    _PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                 ("model.multi_modal_projector.", "multi_modal_projector."))

    def __init__(self, config: Any, **kwargs: Any):
        super().__init__(text_model_config(config), **kwargs)
        self.refuse_pipeline_parallel("Gemma 3")

    @classmethod
    def make_args(cls, config: Any) -> LlamaArgs:
        return dataclasses.replace(super().make_args(text_model_config(config)), final_logit_softcap=None)

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        super().build(config, rngs)
        vision = CLIPVisionArgs.from_hf_config(config.vision_config)
        self.vision_args = vision
        self.mm_tokens_per_image = int(config.mm_tokens_per_image)
        self.image_token_index = int(config.image_token_index)
        self.vision_tower = SiglipVisionModel(vision, dtype=self.dtype, rngs=rngs)
        self.multi_modal_projector = Gemma3MultiModalProjector(vision, self.args.hidden_size,
                                                               self.mm_tokens_per_image, dtype=self.dtype, rngs=rngs)

    # ----- images ----------------------------------------------------------------------
    @property
    def tokens_per_image(self) -> int:
        return self.mm_tokens_per_image

    def get_multimodal_embeddings(self, pixel_values: jax.Array) -> jax.Array:
        """[N, C, H, W] -> [N, mm_tokens_per_image, hidden]."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    # ----- the decoder -----------------------------------------------------------------
    def __call__(self, input_ids, positions, kv_caches, attn_metadata, mm_embeds=None, mm_mask=None):
        check_cache_layout(kv_caches, self.args.num_layers)
        lm = self.model
        if mm_embeds is None:
            x = lm.embed(input_ids, positions)
        else:
            # The soft-token id may lie past the embedding table (transformers embeds id 0 there).
            x = lm.embed(jnp.where(mm_mask != 0, 0, input_ids), positions)
            x = merge_image_rows(x, mm_embeds, mm_mask)
            limits = image_attention_limits(mm_mask, attn_metadata.positions, attn_metadata.token_to_req)
            attn_metadata = dataclasses.replace(attn_metadata, attn_limits=limits)
        x, kv_caches = run_decoder_layers(lm.decoder_layers(), x, positions, kv_caches, attn_metadata)
        return lm.final(x), kv_caches

    def _is_ignored(self, name: str) -> bool:
        # SigLIP's attention-pooling head (vision_use_head): Gemma 3 reads the patch states only.
        return name.startswith("vision_tower.head.") or super()._is_ignored(name)
