"""LLaVA (HF ``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer MLP projector
and the Llama decoder, which takes the projected image rows in place of the ``<image>``
placeholder tokens' embeddings.

What is LLaVA's own, read from the config (no per-checkpoint constants):
- ``vision_feature_layer``: which of the tower's hidden states feed the projector (an int, or a
  list whose states are concatenated on the feature axis);
- ``vision_feature_select_strategy``: "default" drops the class token, "full" keeps it;
- ``projector_hidden_act`` and ``multimodal_projector_bias``.

The engine (worker/encoder_runner.py) runs ``get_multimodal_embeddings`` as its own program,
once per image; the step's body gets the rows of its placeholder tokens as ``mm_embeds`` with
``mm_mask`` and merges them after the token embedding (``__call__``).

Checkpoint names: transformers saves ``language_model.model.*``, ``language_model.lm_head``,
``vision_tower.*`` (llava-hf checkpoints: ``vision_tower.vision_model.*``) and
``multi_modal_projector.*``; newer layouts put ``model.`` in front. ``canonical_name`` maps each
onto this module tree.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.core.kv_cache_utils import KVCacheSpec
from jaxlm.models.base import CausalLMBase, check_cache_layout, run_decoder_layers
from jaxlm.models.clip_vision import CLIPVisionArgs, CLIPVisionModel
from jaxlm.models.layers import Linear, ParallelStyle, get_act_fn
from jaxlm.models.llama import LlamaArgs, LlamaModel
from jaxlm.models.registry import text_model_config
from jaxlm.models.rotary import RotaryEmbedding
from jaxlm.models.vision_language import VisionLanguageMixin, merge_image_rows


class LlavaMultiModalProjector(nnx.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool, *, dtype, rngs: nnx.Rngs):
        self.act = act
        get_act_fn(act)
        kw = dict(bias=bias, parallel=ParallelStyle.REPLICATED, dtype=dtype, rngs=rngs, quantizable=False)
        self.linear_1 = Linear(in_dim, out_dim, **kw)
        self.linear_2 = Linear(out_dim, out_dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(get_act_fn(self.act)(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageMixin, CausalLMBase):
    _PREFIXES = (("model.language_model.", "language_model."), ("language_model.model.", "language_model."),
                 ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                 ("model.multi_modal_projector.", "multi_modal_projector."))

    def __init__(self, config: Any, **kwargs: Any):
        super().__init__(text_model_config(config), **kwargs)
        self.refuse_pipeline_parallel("LLaVA")

    @classmethod
    def make_args(cls, config: Any) -> LlamaArgs:
        return LlamaArgs.from_hf_config(text_model_config(config))

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        vision = CLIPVisionArgs.from_hf_config(config.vision_config)
        self.vision_args = vision
        num_states = vision.num_layers + 1  # HF's hidden_states: the embeddings, then each block
        layers = config.vision_feature_layer
        layers = (layers,) if isinstance(layers, int) else tuple(layers)
        self.feature_layers = tuple(int(i) % num_states for i in layers)
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full)")
        self.drop_cls = strategy == "default"
        self.image_token_index = int(config.image_token_index)
        self.vision_tower = CLIPVisionModel(vision, dtype=self.dtype, rngs=rngs)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(layers), self.args.hidden_size, config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)), dtype=self.dtype, rngs=rngs)
        rope = RotaryEmbedding.from_config(config, self.args.head_dim, max_model_len=self.max_model_len)
        self.language_model = LlamaModel(self.args, rope, dtype=self.dtype, attn_backend=self.attn_backend,
                                         rngs=rngs)

    # ----- images ----------------------------------------------------------------------
    @property
    def tokens_per_image(self) -> int:
        return self.vision_args.num_patches + (0 if self.drop_cls else 1)

    def get_multimodal_embeddings(self, pixel_values: jax.Array) -> jax.Array:
        """[N, C, H, W] -> [N, tokens_per_image, hidden]: the rows of each image's placeholders."""
        states = self.vision_tower(pixel_values, max(self.feature_layers))
        picked = [states[i][:, 1:] if self.drop_cls else states[i] for i in self.feature_layers]
        return self.multi_modal_projector(jnp.concatenate(picked, axis=-1))

    # ----- the decoder -----------------------------------------------------------------
    def __call__(self, input_ids, positions, kv_caches, attn_metadata, mm_embeds=None, mm_mask=None):
        check_cache_layout(kv_caches, self.args.num_layers)
        lm = self.language_model
        x = lm.embed(input_ids, positions)
        if mm_embeds is not None:
            x = merge_image_rows(x, mm_embeds, mm_mask)
        x, kv_caches = run_decoder_layers(lm.decoder_layers(), x, positions, kv_caches, attn_metadata)
        return lm.final(x), kv_caches

    def decoder(self) -> LlamaModel:
        return self.language_model

    def input_embedding(self) -> nnx.Module:
        return self.language_model.embed_tokens

    @classmethod
    def kv_cache_spec(cls, args: LlamaArgs) -> KVCacheSpec:
        return KVCacheSpec(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)

    @classmethod
    def args_for_tensor_parallel(cls, args: LlamaArgs, tp: int) -> LlamaArgs:
        return args.for_tensor_parallel(tp)
