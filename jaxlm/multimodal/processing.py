"""The front end's image preprocessing: the checkpoint's own HF processor (``AutoProcessor``:
resize, crop, normalize, and the ``<image>`` placeholder expanded to the image's token count),
then each image's content hash and placeholder range (multimodal/inputs.py).

Runs at admission (InputProcessor), so a bad image fails its request alone with a ValueError
naming the problem, before anything reaches the engine core.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

from jaxlm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

logger = logging.getLogger(__name__)

# Images per prompt when --limit-mm-per-prompt names none (vLLM's default is higher; every count
# up to it has a compiled encoder program, worker/encoder_runner.py).
DEFAULT_IMAGE_LIMIT = 4


class MultiModalInputError(ValueError):
    """A request's multi_modal_data that cannot be used; ``param`` names the field."""

    param = "multi_modal_data"


def image_limit(limit_mm_per_prompt: dict[str, int] | None) -> int:
    """Images a prompt may carry (``--limit-mm-per-prompt '{"image": N}'``)."""
    limits = dict(limit_mm_per_prompt or {})
    unknown = set(limits) - {"image"}
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: unsupported modality {sorted(unknown)}; supported: image")
    n = limits.get("image", DEFAULT_IMAGE_LIMIT)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"limit_mm_per_prompt: the image limit must be an integer >= 0, got {n!r}")
    return n


class MultiModalProcessor:
    """``hf_config``: the resolved config (text config carrying image_token_index, registry.py);
    ``allowed_local_media_path``: the directory chat file: image URLs may read (None: refused)."""

    def __init__(self, model_path: str, hf_config: Any, limit_mm_per_prompt: dict[str, int] | None = None,
                 allowed_local_media_path: str | None = None):
        self.model_path = model_path
        self.allowed_local_media_path = allowed_local_media_path
        self.image_token_index = int(hf_config.image_token_index)
        self.max_images = image_limit(limit_mm_per_prompt)
        self._processor: Any = None

    @property
    def processor(self) -> Any:
        if self._processor is None:  # transformers' processors import torch: on first use
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.model_path)
        return self._processor

    @property
    def placeholder(self) -> str:
        """The text a prompt holds per image (LLaVA's ``<image>``), what chat image parts become."""
        return getattr(self.processor, "image_token", None) or "<image>"

    def process(self, prompt: Any, images: Any, add_special_tokens: bool = True
                ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """(prompt token ids with placeholders expanded, one feature per image). add_special_tokens:
        False for a chat template's text, which carries BOS itself."""
        from PIL import Image

        if not isinstance(prompt, str):
            raise MultiModalInputError("multi_modal_data needs a text prompt ({'prompt': ..., 'multi_modal_data': "
                                       "...}) holding one image placeholder per image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise MultiModalInputError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, "
                                           f"got {type(image).__name__}")
        if not images:
            raise MultiModalInputError("multi_modal_data['image'] holds no image")
        if len(images) > self.max_images:
            raise MultiModalInputError(f"At most {self.max_images} image(s) may be provided in one prompt, got "
                                       f"{len(images)} (--limit-mm-per-prompt)")
        try:
            out = self.processor(text=prompt, images=[im.convert("RGB") for im in images], return_tensors="np",
                                 add_special_tokens=add_special_tokens)
        except Exception as e:  # noqa: BLE001 - the processor's own refusal, for this request
            raise MultiModalInputError(f"the model's processor refused the input: {e}") from None
        ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
        pixels = np.asarray(out["pixel_values"], np.float32)
        if len(pixels) != len(images):  # e.g. Gemma 3's do_pan_and_scan: crops beside each image
            raise MultiModalInputError(f"the processor made {len(pixels)} pixel arrays of {len(images)} image(s) "
                                       "(image crops, e.g. do_pan_and_scan, are not supported)")
        ranges = self._placeholder_ranges(ids, len(images))
        features = [MultiModalFeatureSpec(data=np.ascontiguousarray(pixels[i]), identifier=_content_hash(pixels[i]),
                                          mm_position=r) for i, r in enumerate(ranges)]
        return ids, features

    def _placeholder_ranges(self, ids: list[int], num_images: int) -> list[PlaceholderRange]:
        """The expanded placeholders, split evenly between the images (each image: one run)."""
        where = np.flatnonzero(np.asarray(ids) == self.image_token_index)
        if num_images == 0 or len(where) % num_images:
            raise MultiModalInputError(f"the prompt holds {len(where)} image placeholder tokens for {num_images} "
                                       "image(s): write one image placeholder per image")
        per = len(where) // num_images
        ranges = []
        for i in range(num_images):
            run = where[i * per:(i + 1) * per]
            if run[-1] - run[0] != per - 1:
                raise MultiModalInputError("an image's placeholder tokens are not contiguous in the prompt")
            ranges.append(PlaceholderRange(int(run[0]), per))
        return ranges


def _content_hash(pixels: np.ndarray) -> str:
    """sha256 of the preprocessed pixels: equal pixels give equal encoder rows."""
    h = hashlib.sha256()
    h.update(str(pixels.shape).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()
