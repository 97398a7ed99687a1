"""The encoder programs of a dynamic-resolution model (Qwen2.5-VL: ``dynamic_resolution``),
where an image's size, and so its patch and token counts, vary.

A request's images are encoded together: their patches [n, C*T*P*P] back to back, padded to a
bucket of patch counts (powers of two from 64 up to the prompt's most: the image limit times the
processor's ``max_pixels`` in patches), with each patch's row/column, image frame and window
computed on the host (qwen2_5_vision.vision_patch_layout), put in window order and the rows put
back after (window_order). The masks keep images, windows and padding apart, so the padding
changes no real row. Every bucket is compiled at warm-up; serving
never compiles. The rows come back one per merged token, image after image, in prompt order.
The encoder cache and the step rows are EncoderRunner's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.qwen2_5_vision import vision_patch_layout, window_order
from jaxlm.worker.encoder_runner import EncoderRunner

logger = logging.getLogger(__name__)

_MIN_BUCKET = 64
# Past this many patches the full layers' dense [P, P] attention gets heavy (memory and time).
_LARGE_BUCKET = 16384


def max_image_patches(model_path: str, patch_size: int, mm_processor_kwargs: dict[str, Any] | None = None) -> int:
    """Patches of the largest image the checkpoint's image processor makes (its ``max_pixels``,
    or ``size.longest_edge`` as transformers 5.x saves it), from --mm-processor-kwargs, else from
    preprocessor_config.json."""
    from jaxlm.model_loader.hf_cache import resolve_model_path

    max_pixels = _max_pixels(mm_processor_kwargs or {})
    path = os.path.join(resolve_model_path(model_path), "preprocessor_config.json")
    if max_pixels is None:
        try:
            with open(path) as f:
                max_pixels = _max_pixels(json.load(f))
        except OSError as e:
            raise ValueError(f"a dynamic-resolution model needs its image processor's preprocessor_config.json: "
                             f"{e}") from None
    if not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels < patch_size ** 2:
        raise ValueError(f"max_pixels (--mm-processor-kwargs, else {path}) must be an integer of at least one "
                         f"patch ({patch_size ** 2} pixels), got {max_pixels!r}: it sizes the encoder's buckets")
    return max_pixels // patch_size ** 2


def _max_pixels(cfg: dict[str, Any]) -> Any:
    if cfg.get("max_pixels") is not None:
        return cfg["max_pixels"]
    size = cfg.get("size")
    return size.get("longest_edge") if isinstance(size, dict) else None


def patch_buckets(max_patches: int, merge_unit: int) -> list[int]:
    """Powers of two from 64 below max_patches, then max_patches rounded up to merge_unit."""
    top = -(-max_patches // merge_unit) * merge_unit
    buckets, n = [], _MIN_BUCKET
    while n < top:
        buckets.append(n)
        n *= 2
    return buckets + [top]


class PatchEncoderRunner(EncoderRunner):
    def __init__(self, model: nnx.Module, graphdef: Any, treedef: Any, max_images: int,
                 replicated: jax.sharding.NamedSharding | None, max_patches_per_image: int):
        self._max_patches = max_images * max_patches_per_image
        super().__init__(model, graphdef, treedef, max_images, replicated)

    def _setup(self, model: nnx.Module, max_images: int) -> None:
        self.vision_args = model.vision_args
        self.merge_unit = model.vision_args.merge_unit
        self.buckets = patch_buckets(self._max_patches, self.merge_unit) if max_images > 0 else []
        logger.info("vision encoder buckets (patches): %s", self.buckets)
        if self.buckets and self.buckets[-1] > _LARGE_BUCKET:
            logger.warning("the vision encoder's largest bucket is %d patches (%d image(s) of up to max_pixels): "
                           "its full-attention layers are dense, [P, P] per head; lower max_pixels "
                           "(--mm-processor-kwargs) or --limit-mm-per-prompt", self.buckets[-1], max_images)

    def _check_feature(self, req_id: str, f: Any) -> None:
        t, h, w = f.grid_thw or (0, 0, 0)
        if f.grid_thw is None or f.data.shape != (t * h * w, self.vision_args.patch_dim) \
                or f.mm_position.length * self.merge_unit != t * h * w:
            raise ValueError(f"request {req_id}: an image's patches {f.data.shape}, grid {f.grid_thw} and "
                             f"{f.mm_position.length} placeholder tokens do not agree")

    def _input_specs(self, n: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Patches [n, C*T*P*P], then each patch's (row, column) [n, 2], frame [n] and window [n]."""
        rep = self.replicated
        return (jax.ShapeDtypeStruct((n, self.vision_args.patch_dim), jnp.float32, sharding=rep),
                jax.ShapeDtypeStruct((n, 2), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep))

    def _encode(self, param_leaves: list[Any], features: list[Any]) -> list[np.ndarray]:
        start = time.perf_counter()
        sizes = [len(f.data) for f in features]
        total = sum(sizes)
        bucket = next((b for b in self.buckets if b >= total), None)
        if bucket is None:
            raise ValueError(f"{total} patches exceed the encoder's largest bucket {self.buckets[-1]}")
        pixels = np.zeros((bucket, self.vision_args.patch_dim), np.float32)
        pixels[:total] = np.concatenate([f.data for f in features])
        pos, frame, window = vision_patch_layout([f.grid_thw for f in features], self.vision_args, bucket)
        order = window_order(window, total)
        read = [param_leaves[i] for i in self._leaf_index]
        windowed = np.asarray(self._programs[bucket](read, pixels[order], pos[order], frame[order], window[order]))
        rows = np.empty_like(windowed)
        rows[order[::self.merge_unit] // self.merge_unit] = windowed  # back in the prompt's order
        self.num_encoded += len(features)
        logger.debug("encoded %d image(s), %d patches in %.1f ms", len(features), total,
                     1e3 * (time.perf_counter() - start))
        ends = np.cumsum(sizes) // self.merge_unit
        return [rows[e - n // self.merge_unit:e] for e, n in zip(ends, sizes)]
