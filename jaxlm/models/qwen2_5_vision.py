"""Qwen2.5-VL's vision transformer (HF ``Qwen2_5_VisionTransformerPretrainedModel``) and the
host-side layout of its patches.

What is its own, read from the vision config:
- dynamic resolution: the processor cuts an image into ``patch_size`` squares (``temporal_patch_size``
  frames, an image repeated), flattened [patches, C*T*P*P] in merge-block order (each 2x2 block of
  patches that becomes one token is consecutive), and gives the (t, h, w) patch grid;
- the patch embedding: a bias-free Conv3d whose stride equals its kernel, i.e. one matmul;
- 2-D rotary in every block: a head's first half of frequencies turns with the patch's row, the
  second half with its column (theta from the vision rope_parameters, default 10000);
- window attention: a block attends within windows of ``window_size`` pixels (whole merge blocks),
  the blocks of ``fullatt_block_indexes`` within the whole image (frame);
- RMSNorm, a SwiGLU MLP with biases, and the patch merger (RMSNorm, each merge block's 4 patch
  states concatenated, Linear-GELU-Linear to the decoder's width).

The engine pads a request's patches to a bucket (worker/patch_encoder_runner.py): attention is
masked by segment ids computed here on the host (``vision_patch_layout``), so images, windows
and padding never see each other. As transformers does, the host puts the patches in window
order (``window_order``: each window's patches consecutive, merge blocks whole) and the merged
rows back in the prompt's order; so a window layer scores each block of ``window_patches``
queries against the 3 blocks around it only (P x 3 x window scores, not P x P), while the full
layers score every pair of a bucket (masked by image frame). Replicated under tensor
parallel, never quantized.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.layers import Linear, ParallelStyle, RMSNorm, get_act_fn
from jaxlm.models.utils import make_param

_EPS = 1e-6  # transformers' fixed RMSNorm epsilon in the tower and the merger


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VisionArgs:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    hidden_act: str
    rope_theta: float

    @classmethod
    def from_hf_config(cls, c: Any) -> "Qwen2_5_VisionArgs":
        rope = getattr(c, "rope_parameters", None) or {}
        return cls(depth=int(c.depth), hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size),
                   num_heads=int(c.num_heads), in_channels=int(c.in_channels), patch_size=int(c.patch_size),
                   temporal_patch_size=int(c.temporal_patch_size), spatial_merge_size=int(c.spatial_merge_size),
                   window_size=int(c.window_size), out_hidden_size=int(c.out_hidden_size),
                   fullatt_block_indexes=tuple(int(i) for i in c.fullatt_block_indexes),
                   hidden_act=getattr(c, "hidden_act", "silu"), rope_theta=float(rope.get("rope_theta", 10000.0)))

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def window_tokens(self) -> int:
        """A window's side in merged tokens."""
        return max(self.window_size // self.spatial_merge_size // self.patch_size, 1)

    @property
    def window_patches(self) -> int:
        """Patches of the largest window (a whole one)."""
        return self.window_tokens ** 2 * self.merge_unit


def vision_patch_layout(grids: Sequence[tuple[int, int, int]], a: Qwen2_5_VisionArgs, num_patches: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the images' patches back to back, padded to ``num_patches``: (row and column of each
    patch [P, 2], its image frame's id [P], its window's id [P]) as int32; padding gets -1 (its
    own segment). Patches come in merge-block order: block (i, j) of the merged grid row-major,
    then its m x m patches row-major (transformers' ``get_vision_position_ids``)."""
    m, ws = a.spatial_merge_size, a.window_tokens
    pos = np.zeros((num_patches, 2), np.int32)
    frame = np.full(num_patches, -1, np.int32)
    window = np.full(num_patches, -1, np.int32)
    start = frames = windows = 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        bi, bj, a_, b_ = np.meshgrid(np.arange(gh), np.arange(gw), np.arange(m), np.arange(m), indexing="ij")
        rows, cols = (bi * m + a_).ravel(), (bj * m + b_).ravel()
        nwh, nww = -(-gh // ws), -(-gw // ws)
        win = ((bi // ws) * nww + bj // ws).ravel()
        n = h * w
        for k in range(t):
            sl = slice(start + k * n, start + (k + 1) * n)
            pos[sl, 0], pos[sl, 1] = rows, cols
            frame[sl] = frames + k
            window[sl] = windows + k * nwh * nww + win
        start, frames, windows = start + t * n, frames + t, windows + t * nwh * nww
    if start > num_patches:
        raise ValueError(f"{start} patches do not fit the encoder's bucket of {num_patches}")
    return pos, frame, window


def window_order(window: np.ndarray, num_real: int) -> np.ndarray:
    """The patches' order with each window's patches consecutive (transformers' ``window_index``,
    at patch level): the real patches by window id, stably (a window's merge blocks keep their
    row-major order and each block its 4 patches), then the padding. Merge blocks stay whole, so
    the merged rows come out in this order, one per block."""
    return np.concatenate([np.argsort(window[:num_real], kind="stable"),
                           np.arange(num_real, len(window))]).astype(np.int32)


def _linear(i: int, o: int, bias: bool = True, *, dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(i, o, bias=bias, parallel=ParallelStyle.REPLICATED, dtype=dtype, rngs=rngs, quantizable=False)


def _rotate_2d(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Qwen2_5_VisionAttention(nnx.Module):
    def __init__(self, a: Qwen2_5_VisionArgs, *, dtype, rngs: nnx.Rngs):
        d = a.hidden_size
        self.num_heads, self.head_dim = a.num_heads, d // a.num_heads
        self.qkv = _linear(d, 3 * d, dtype=dtype, rngs=rngs)
        self.proj = _linear(d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment: jax.Array, band: int | None
                 ) -> jax.Array:
        """x [P, D]; cos/sin [P, 1, head_dim/2]; a patch attends to the patches of its segment [P].
        band None: any of them (dense [P, P]); else segments are runs of at most ``band``
        consecutive patches (windows in window order) and only keys within the band are scored."""
        p = x.shape[0]
        qkv = self.qkv(x).reshape(p, 3, self.num_heads, self.head_dim)
        q, k, v = _rotate_2d(qkv[:, 0], cos, sin), _rotate_2d(qkv[:, 1], cos, sin), qkv[:, 2]
        attend = _dense_attention if band is None else functools.partial(_banded_attention, band=band)
        out = attend(q, k, v, segment, self.head_dim ** -0.5)
        return self.proj(out.reshape(p, -1))


def _softmax_rows(scores: jax.Array, mask: jax.Array, v_dtype) -> jax.Array:
    # A finite fill: a row with no key (the band's padding queries) stays finite, and is dropped.
    return jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(v_dtype)


def _dense_attention(q, k, v, segment, scale):
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * scale
    probs = _softmax_rows(scores, (segment[:, None] == segment[None, :])[None], v.dtype)
    return jnp.einsum("hqk,khd->qhd", probs, v)


def _banded_attention(q, k, v, segment, scale, band: int):
    """Queries in blocks of ``band``; block i scores the keys [i*band - band, i*band + 2*band),
    which hold every key of a segment (a run of at most ``band``) that one of its queries is in:
    P x 3*band scores a head instead of P x P."""
    p, h, d = q.shape
    nb = -(-p // band)
    tail = nb * band - p
    q_blocks = jnp.pad(q, ((0, tail), (0, 0), (0, 0))).reshape(nb, band, h, d)
    q_seg = jnp.pad(segment, (0, tail), constant_values=-3).reshape(nb, band)
    around = ((band, tail + band), (0, 0), (0, 0))
    keys = np.arange(nb)[:, None] * band + np.arange(3 * band)[None, :]  # into the padded keys
    k_blocks, v_blocks = jnp.pad(k, around)[keys], jnp.pad(v, around)[keys]  # [nb, 3*band, h, d]
    k_seg = jnp.pad(segment, (band, tail + band), constant_values=-2)[keys]
    scores = jnp.einsum("nqhd,nkhd->nhqk", q_blocks, k_blocks, preferred_element_type=jnp.float32) * scale
    probs = _softmax_rows(scores, (q_seg[:, :, None] == k_seg[:, None, :])[:, None], v.dtype)
    return jnp.einsum("nhqk,nkhd->nqhd", probs, v_blocks).reshape(nb * band, h, d)[:p]


class Qwen2_5_VisionMLP(nnx.Module):
    def __init__(self, a: Qwen2_5_VisionArgs, *, dtype, rngs: nnx.Rngs):
        self.act = a.hidden_act
        get_act_fn(self.act)  # fail at construction
        self.gate_proj = _linear(a.hidden_size, a.intermediate_size, dtype=dtype, rngs=rngs)
        self.up_proj = _linear(a.hidden_size, a.intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = _linear(a.intermediate_size, a.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(get_act_fn(self.act)(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5_VisionBlock(nnx.Module):
    def __init__(self, a: Qwen2_5_VisionArgs, *, dtype, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(a.hidden_size, eps=_EPS, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(a.hidden_size, eps=_EPS, dtype=dtype, rngs=rngs)
        self.attn = Qwen2_5_VisionAttention(a, dtype=dtype, rngs=rngs)
        self.mlp = Qwen2_5_VisionMLP(a, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segment, band):
        x = x + self.attn(self.norm1(x), cos, sin, segment, band)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VLPatchMerger(nnx.Module):
    """HF's ``merger``: ``ln_q``, then ``mlp.0`` / GELU / ``mlp.2`` (here ``mlp_0`` / ``mlp_2``:
    Qwen2_5_VLForConditionalGeneration.canonical_name maps the checkpoint's names)."""

    def __init__(self, a: Qwen2_5_VisionArgs, *, dtype, rngs: nnx.Rngs):
        width = a.hidden_size * a.merge_unit
        self.ln_q = RMSNorm(a.hidden_size, eps=_EPS, dtype=dtype, rngs=rngs)
        self.mlp_0 = _linear(width, width, dtype=dtype, rngs=rngs)
        self.mlp_2 = _linear(width, a.out_hidden_size, dtype=dtype, rngs=rngs)
        self.width = width

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.ln_q(x).reshape(-1, self.width)
        return self.mlp_2(jax.nn.gelu(self.mlp_0(x), approximate=False))


class Qwen2_5_VisionTransformer(nnx.Module):
    """Under HF's names: ``patch_embed.proj``, ``blocks.i``, ``merger``."""

    def __init__(self, a: Qwen2_5_VisionArgs, *, dtype, rngs: nnx.Rngs):
        if a.hidden_size % a.num_heads or (a.hidden_size // a.num_heads) % 4:
            raise ValueError(f"Qwen2.5-VL vision: head dim {a.hidden_size}/{a.num_heads} must be a multiple of 4 "
                             "(2-D rotary: half the frequencies a row, half a column)")
        self.args = a
        self.patch_embed = nnx.Module()  # HF's Conv3d weight [D, C, T, P, P], no bias
        self.patch_embed.proj = nnx.Module()
        self.patch_embed.proj.weight = make_param(
            rngs, (a.hidden_size, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size), dtype,
            (None,) * 5)
        self.blocks = nnx.List([Qwen2_5_VisionBlock(a, dtype=dtype, rngs=rngs) for _ in range(a.depth)])
        self.merger = Qwen2_5_VLPatchMerger(a, dtype=dtype, rngs=rngs)

    def __call__(self, pixel_values: jax.Array, pos: jax.Array, frame: jax.Array, window: jax.Array) -> jax.Array:
        """pixel_values [P, C*T*P*P], pos [P, 2], frame / window [P] (vision_patch_layout), in
        window order (window_order) -> [P / merge_unit, out_hidden_size]: one row per merge block,
        in that order."""
        a = self.args
        w = self.patch_embed.proj.weight[...]
        x = pixel_values.astype(w.dtype) @ w.reshape(w.shape[0], -1).T
        head_dim = a.hidden_size // a.num_heads
        quarter = head_dim // 4
        inv_freq = 1.0 / (a.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
        angles = pos.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)  # [P, 2, quarter]
        angles = angles.reshape(pos.shape[0], 1, 2 * quarter)  # row's frequencies, then column's
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        for i, block in enumerate(self.blocks):
            full = i in a.fullatt_block_indexes
            x = block(x, cos, sin, frame if full else window, None if full else a.window_patches)
        return self.merger(x)
