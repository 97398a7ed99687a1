"""What the vision-language families share around their own towers and projectors: the
checkpoint's names (transformers' old and new layouts), the size of one preprocessed image, and
the merge of an image's rows into the step's token embeddings at its placeholders."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


class VisionLanguageMixin:
    """Mixed into a decoder-only class; the family sets `_PREFIXES` ((checkpoint prefix, ours))
    and `vision_args` (the tower's args: num_channels, image_size)."""

    supports_multimodal = True
    _PREFIXES: tuple[tuple[str, str], ...] = ()
    vision_args: Any

    def refuse_pipeline_parallel(self, family: str) -> None:
        if self.pipeline_size > 1:
            raise ValueError(f"pipeline parallel does not run image inputs yet: serve {family} without it")

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one preprocessed image: the tower's position embeddings fix its size."""
        a = self.vision_args
        return a.num_channels, a.image_size, a.image_size

    def canonical_name(self, name: str) -> str:
        for old, new in self._PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


def merge_image_rows(x: jax.Array, mm_embeds: jax.Array, mm_mask: jax.Array) -> jax.Array:
    """The step's embeddings [T, H] with the image rows where mm_mask is set."""
    return jnp.where(mm_mask[:, None] != 0, mm_embeds.astype(x.dtype), x)
