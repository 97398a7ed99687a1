"""Qwen2.5-VL (HF ``Qwen2_5_VLForConditionalGeneration``): its vision transformer and patch
merger (qwen2_5_vision.py) and the Qwen2 decoder with M-RoPE, which takes the merged image rows
in place of the ``<|image_pad|>`` placeholder tokens' embeddings.

What is Qwen2.5-VL's own, read from the config:
- dynamic resolution: an image's token count follows its size (the processor's patch grid
  divided by ``spatial_merge_size`` squared), so the encoder runs over a request's patches
  padded to a bucket of patch counts (``dynamic_resolution``; worker/patch_encoder_runner.py);
- M-RoPE (``rope_parameters.mrope_section``): every layer's rope turns with three position rows,
  which the runner computes on the host per step (multimodal/mrope.py, worker/mrope_positions.py)
  and hands in as ``mrope_positions`` [3, T]; the attention metadata keeps the sequence index
  (KV slots, causality and windows are those of the prompt's token order).

Checkpoint names: transformers 5.x saves ``model.language_model.*``, ``model.visual.*`` and
``lm_head.*``; older checkpoints ``model.*`` (the decoder), ``visual.*`` and ``lm_head.*``. The
merger's ``mlp.0`` / ``mlp.2`` become ``mlp_0`` / ``mlp_2`` (``canonical_name``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.base import check_cache_layout, run_decoder_layers
from jaxlm.models.llama import LlamaArgs, Qwen2ForCausalLM
from jaxlm.models.qwen2_5_vision import Qwen2_5_VisionArgs, Qwen2_5_VisionTransformer
from jaxlm.models.registry import text_model_config
from jaxlm.models.rotary import MRotaryEmbedding
from jaxlm.models.vision_language import VisionLanguageMixin, merge_image_rows


class Qwen2_5_VLForConditionalGeneration(VisionLanguageMixin, Qwen2ForCausalLM):
    # The image size varies: the encoder is bucketed by patch count (worker/patch_encoder_runner.py).
    dynamic_resolution = True
    # The rope takes [3, T] positions (worker/mrope_positions.py).
    uses_mrope = True
    _PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def __init__(self, config: Any, **kwargs: Any):
        super().__init__(text_model_config(config), **kwargs)
        self.refuse_pipeline_parallel("Qwen2.5-VL")

    @classmethod
    def make_args(cls, config: Any) -> LlamaArgs:
        return super().make_args(text_model_config(config))

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        super().build(config, rngs)
        self.vision_args = Qwen2_5_VisionArgs.from_hf_config(config.vision_config)
        if self.vision_args.out_hidden_size != self.args.hidden_size:
            raise ValueError(f"Qwen2.5-VL: vision out_hidden_size {self.vision_args.out_hidden_size} != the "
                             f"decoder's hidden_size {self.args.hidden_size}")
        self.image_token_index = int(config.image_token_id)
        self.visual = Qwen2_5_VisionTransformer(self.vision_args, dtype=self.dtype, rngs=rngs)

    def layer_ropes(self, config: Any) -> tuple[MRotaryEmbedding, ...]:
        rope = MRotaryEmbedding.from_config(config, self.args.head_dim, max_model_len=self.max_model_len)
        return (rope,) * self.args.num_layers

    # ----- images ----------------------------------------------------------------------
    def get_multimodal_embeddings(self, pixel_values: jax.Array, pos: jax.Array, frame: jax.Array,
                                  window: jax.Array) -> jax.Array:
        """A request's patches padded to a bucket [P, C*T*P*P] and their layout
        (qwen2_5_vision.vision_patch_layout) -> [P / merge_unit, hidden]."""
        return self.visual(pixel_values, pos, frame, window)

    # ----- the decoder -----------------------------------------------------------------
    def __call__(self, input_ids, positions, kv_caches, attn_metadata, mm_embeds=None, mm_mask=None,
                 mrope_positions=None):
        check_cache_layout(kv_caches, self.args.num_layers)
        lm = self.model
        # The placeholder id may lie past the embedding table of a trimmed vocabulary: embed 0 there.
        x = lm.embed(input_ids if mm_mask is None else jnp.where(mm_mask != 0, 0, input_ids), positions)
        if mm_embeds is not None:
            x = merge_image_rows(x, mm_embeds, mm_mask)
        rope_positions = positions if mrope_positions is None else mrope_positions
        x, kv_caches = run_decoder_layers(lm.decoder_layers(), x, rope_positions, kv_caches, attn_metadata)
        return lm.final(x), kv_caches

    def canonical_name(self, name: str) -> str:
        name = super().canonical_name(name)
        if name.startswith("visual.merger.mlp."):
            name = name.replace("visual.merger.mlp.", "visual.merger.mlp_", 1)
        return name
