"""M-RoPE positions of a prompt (Qwen2-VL's ``get_rope_index``; vLLM's
``MRotaryEmbedding.get_input_positions``), on the host: numpy, no jax.

Text tokens count up as usual, the same number in the three rows (temporal, height, width).
An image's tokens take the position ``start`` the next text token would have, plus their place
in the image's merged grid: t + start, h + start, w + start. The text after an image goes on
from ``start + max(grid h, grid w)`` (the image's largest position + 1). The prompt's last
position + 1 minus its length is the request's ``mrope_position_delta``: every later token
(decode) is at its index + delta in all three rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def mrope_input_positions(num_tokens: int, images: Sequence[tuple[int, int, tuple[int, int, int]]],
                          spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """([3, num_tokens] int32 positions, mrope_position_delta). ``images``: (offset, length,
    (t, h, w) patch grid) of each image's placeholder run, in prompt order."""
    out = np.empty((3, num_tokens), np.int64)
    index, start = 0, 0  # the next prompt index, and the position its token gets
    for offset, length, (t, h, w) in sorted(images):
        gt, gh, gw = t, h // spatial_merge_size, w // spatial_merge_size
        if gt * gh * gw != length or offset < index:
            raise ValueError(f"an image's {length} placeholder tokens at {offset} do not match its "
                             f"{t}x{h}x{w} patch grid (merge {spatial_merge_size})")
        n = offset - index
        out[:, index:offset] = start + np.arange(n)
        start += n
        tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, offset:offset + length] = start + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        start += max(gh, gw)
        index = offset + length
    out[:, index:] = start + np.arange(num_tokens - index)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out.astype(np.int32), delta
