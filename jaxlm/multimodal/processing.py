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
    ``allowed_local_media_path``: the directory chat file: image URLs may read (None: refused);
    ``mm_processor_kwargs``: image processor options (hf_processor.load_processor)."""

    def __init__(self, model_path: str, hf_config: Any, limit_mm_per_prompt: dict[str, int] | None = None,
                 allowed_local_media_path: str | None = None, mm_processor_kwargs: dict[str, Any] | None = None):
        self.model_path = model_path
        self.mm_processor_kwargs = mm_processor_kwargs
        self.allowed_local_media_path = allowed_local_media_path
        token = getattr(hf_config, "image_token_index", None)
        self.image_token_index = int(token if token is not None else hf_config.image_token_id)
        # Qwen2-VL: an image is <|vision_start|><|image_pad|><|vision_end|> in a prompt.
        self._vision_marks = (getattr(hf_config, "vision_start_token_id", None),
                              getattr(hf_config, "vision_end_token_id", None))
        self.max_images = image_limit(limit_mm_per_prompt)
        self._processor: Any = None
        if mm_processor_kwargs:  # a wrong option fails the engine's start, not its first image
            _ = self.processor

    @property
    def processor(self) -> Any:
        if self._processor is None:  # transformers' processors import torch: on first use
            from jaxlm.multimodal.hf_processor import load_processor

            self._processor = load_processor(self.model_path, self.mm_processor_kwargs)
        return self._processor

    @property
    def placeholder(self) -> str:
        """The text a prompt holds per image (LLaVA's ``<image>``; Qwen2-VL's image token between
        its vision start and end tokens, as vLLM), what chat image parts become."""
        token = getattr(self.processor, "image_token", None) or "<image>"
        start, end = self._vision_marks
        if start is None or end is None:
            return token
        to_text = self.processor.tokenizer.convert_ids_to_tokens
        return f"{to_text(int(start))}{token}{to_text(int(end))}"

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
        pixels, grids = _split_pixels(out, len(images))
        where = np.flatnonzero(np.asarray(ids) == self.image_token_index)
        if grids is None:  # a fixed size: the placeholders split evenly between the images
            per = len(where) // len(images) if len(where) % len(images) == 0 else -1
            counts = [per] * len(images)
        else:  # dynamic resolution (Qwen2-VL): each image's tokens follow its patch grid
            merge = int(getattr(self.processor.image_processor, "merge_size", 1))
            counts = [int(np.prod(g)) // merge ** 2 for g in grids]
        ranges = _placeholder_ranges(where, counts)
        features = [MultiModalFeatureSpec(data=np.ascontiguousarray(pixels[i]),
                                          identifier=_content_hash(pixels[i], grids and grids[i]), mm_position=r,
                                          grid_thw=grids and grids[i]) for i, r in enumerate(ranges)]
        return ids, features


def _split_pixels(out: Any, num_images: int) -> tuple[list[np.ndarray], list[tuple[int, int, int]] | None]:
    """Each image's pixels ([C, H, W]; with ``image_grid_thw``, its patches [n, C*T*P*P]) and
    its patch grid (None: a fixed-size model)."""
    pixels = np.asarray(out["pixel_values"], np.float32)
    if "image_grid_thw" in out:
        grids = [tuple(int(x) for x in g) for g in np.asarray(out["image_grid_thw"])]
        sizes = [t * h * w for t, h, w in grids]
        if len(grids) != num_images or sum(sizes) != len(pixels):
            raise MultiModalInputError(f"the processor made {len(grids)} patch grids ({sum(sizes)} patches, "
                                       f"{len(pixels)} given) for {num_images} image(s)")
        return np.split(pixels, np.cumsum(sizes)[:-1]), grids
    if len(pixels) != num_images:  # e.g. Gemma 3's do_pan_and_scan: crops beside each image
        raise MultiModalInputError(f"the processor made {len(pixels)} pixel arrays of {num_images} image(s) "
                                   "(image crops, e.g. do_pan_and_scan, are not supported)")
    return list(pixels), None


def _placeholder_ranges(where: np.ndarray, counts: list[int]) -> list[PlaceholderRange]:
    """The expanded placeholders (their prompt indices ``where``), ``counts[i]`` for image i, in
    order, each image's one contiguous run."""
    if min(counts) <= 0 or sum(counts) != len(where):
        raise MultiModalInputError(f"the prompt holds {len(where)} image placeholder tokens for {len(counts)} "
                                   "image(s): write one image placeholder per image")
    ranges, start = [], 0
    for n in counts:
        run = where[start:start + n]
        if run[-1] - run[0] != n - 1:
            raise MultiModalInputError("an image's placeholder tokens are not contiguous in the prompt")
        ranges.append(PlaceholderRange(int(run[0]), n))
        start += n
    return ranges


def _content_hash(pixels: np.ndarray, grid: tuple[int, int, int] | None = None) -> str:
    """sha256 of the preprocessed pixels (and patch grid): equal pixels give equal encoder rows."""
    h = hashlib.sha256()
    h.update(str((pixels.shape, grid)).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()
