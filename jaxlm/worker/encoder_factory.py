"""Which encoder runner a multimodal model gets: one over image counts (worker/encoder_runner.py)
or one over patch counts (worker/patch_encoder_runner.py); each module stays free of the other."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxlm.worker.encoder_runner import EncoderRunner
from jaxlm.worker.patch_encoder_runner import PatchEncoderRunner, max_image_patches


def make_encoder_runner(model: nnx.Module, graphdef: Any, treedef: Any, model_config: Any,
                        replicated: jax.sharding.NamedSharding | None) -> EncoderRunner:
    """The encoder runner of a multimodal model: by image count (a fixed image size), or by patch
    count for a dynamic-resolution model (worker/patch_encoder_runner.py)."""
    from jaxlm.multimodal.processing import image_limit

    max_images = image_limit(model_config.limit_mm_per_prompt)
    if not getattr(model, "dynamic_resolution", False):
        return EncoderRunner(model, graphdef, treedef, max_images, replicated)

    per_image = max_image_patches(model_config.model, model.vision_args.patch_size,
                                  model_config.mm_processor_kwargs)
    return PatchEncoderRunner(model, graphdef, treedef, max_images, replicated, per_image)
