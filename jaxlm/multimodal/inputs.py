"""What one image of a request carries from the front end to the runner (vLLM's names).

msgspec Structs: they travel inside EngineCoreRequest to an engine-core process (the pixel
array as raw bytes, engine/messages.py). No jax here: the core (scheduler, prefix cache) reads
the placeholder ranges and the hash; only the runner reads the pixels.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec
import numpy as np


class PlaceholderRange(msgspec.Struct, array_like=True, frozen=True):
    """The image's placeholder tokens: prompt positions [offset, offset + length)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class MultiModalFeatureSpec(msgspec.Struct, array_like=True):
    """One image of a request: its preprocessed pixels [C, H, W] (float32; a dynamic-resolution
    model's: its patches [n, C*T*P*P] and their (t, h, w) ``grid_thw``), its content hash (vLLM's
    mm_hash: the same pixels, the same rows) and where its placeholders sit."""

    data: np.ndarray
    identifier: str
    mm_position: PlaceholderRange
    modality: str = "image"
    grid_thw: tuple[int, int, int] | None = None

    @property
    def hash_key(self) -> int:
        """The whole sha256 as an int (Python's str hash is salted per process; an int's is not);
        kept in the block's key, so only a sha256 collision could alias two images' KV."""
        return int(self.identifier, 16)


def block_extra_keys(features: Sequence[MultiModalFeatureSpec] | None, block_size: int,
                     block_index: int) -> tuple[int, ...]:
    """The hashes of the images whose placeholders overlap block ``block_index``: mixed into that
    block's prefix-cache hash, so the same tokens with another image never share its K/V (and,
    the hashes being chained, neither do the blocks after it)."""
    if not features:
        return ()
    start, end = block_index * block_size, (block_index + 1) * block_size
    return tuple(f.hash_key for f in features if f.mm_position.offset < end and start < f.mm_position.end)


def chunk_end_before_split_item(features: Sequence[MultiModalFeatureSpec], start: int, num_new_tokens: int) -> int:
    """vLLM's disable_chunked_mm_input: the prompt chunk [start, start + num_new_tokens) cut back
    so that it does not end inside an image's placeholders (to before the image; 0 when it starts
    inside one it cannot finish)."""
    end = start + num_new_tokens
    for f in features:
        lo, hi = f.mm_position.offset, f.mm_position.end
        if lo < end < hi:
            return max(lo - start, 0)
    return num_new_tokens


class ChatImages:
    """The images of a conversation's ``image_url`` parts, in order, and the placeholder text the
    model's processor expands (LLaVA's ``<image>``); as vLLM, a message's placeholders come
    before its text. A text-only model has none: its image parts are refused.
    allowed_local_media_path: the directory file: URLs may read (None: they are refused)."""

    def __init__(self, placeholder: str, allowed_local_media_path: str | None = None) -> None:
        self.placeholder = placeholder
        self.allowed_local_media_path = allowed_local_media_path
        self.images: list[Any] = []
