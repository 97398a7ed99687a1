"""The checkpoint's HF processor, or, where transformers cannot build it, its image processor and
tokenizer with the placeholders expanded as that processor does.

transformers 5.x's Qwen2-VL / Qwen2.5-VL processors hold a video processor, which needs
torchvision; without it ``AutoProcessor`` raises ImportError, though images need none of it.
``ImageTokenProcessor`` then does what ``Qwen2_5_VLProcessor.__call__`` does for images: the
image processor (``AutoImageProcessor``: resize to the patch grid, normalize, flatten patches)
gives ``pixel_values`` and ``image_grid_thw``; each image token of the text becomes
``grid.prod() // merge_size**2`` of them, in order; the tokenizer encodes the result.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class ImageTokenProcessor:
    """An image processor + tokenizer pair, called like an HF processor (images only)."""

    def __init__(self, image_processor: Any, tokenizer: Any, image_token: str):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def __call__(self, text: str, images: list[Any], return_tensors: str = "np",
                 add_special_tokens: bool = True) -> dict[str, Any]:
        out = dict(self.image_processor(images=images, return_tensors="np"))
        merge = int(getattr(self.image_processor, "merge_size", 1))
        counts = [int(np.prod(g)) // merge ** 2 for g in np.asarray(out["image_grid_thw"])]
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholder(s) ({self.image_token}) for "
                             f"{len(counts)} image(s): write one per image")
        expanded = pieces[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        out["input_ids"] = np.asarray([ids], np.int64)
        return out


def load_processor(model_path: str, mm_processor_kwargs: dict[str, Any] | None = None) -> Any:
    """``AutoProcessor`` for the checkpoint, or ImageTokenProcessor when transformers cannot
    build it for want of torchvision (its video processor). mm_processor_kwargs: options of the
    image processor, each one it takes (else ValueError naming it), on top of its saved config."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    kwargs = dict(mm_processor_kwargs or {})
    try:
        processor = AutoProcessor.from_pretrained(model_path)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
        logger.info("the checkpoint's processor needs torchvision (videos): using its image processor and "
                    "tokenizer for images")
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        processor = ImageTokenProcessor(AutoImageProcessor.from_pretrained(model_path), tokenizer,
                                        getattr(tokenizer, "image_token", None) or "<|image_pad|>")
    if kwargs:
        _check_image_kwargs(processor.image_processor, kwargs)
        processor.image_processor = AutoImageProcessor.from_pretrained(model_path, **kwargs)
    return processor


def _check_image_kwargs(image_processor: Any, kwargs: dict[str, Any]) -> None:
    # transformers ignores options an image processor does not take: refuse them instead.
    valid = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", None) or {}
    unknown = sorted(k for k in kwargs if k not in valid and not hasattr(image_processor, k))
    if unknown:
        raise ValueError(f"mm_processor_kwargs: {type(image_processor).__name__} takes no option "
                         f"{', '.join(map(repr, unknown))}; it takes: {', '.join(sorted(valid)) or 'none'}")
