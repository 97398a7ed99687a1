"""The C++ GGUF block matmul (gguf_matmul.cc) as a JAX function, its weight layout, and its NumPy references."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class GGUFBlockType(NamedTuple):
    """A GGML block type the kernel multiplies in place: its name, values and bytes per block."""

    name: str
    block_size: int
    type_size: int


# GGML type id -> its blocks (llama.cpp's layouts; gguf_matmul.cc and gguf_kquants.h).
GGUF_KERNEL_TYPES = {
    2: GGUFBlockType("Q4_0", 32, 18), 3: GGUFBlockType("Q4_1", 32, 20), 8: GGUFBlockType("Q8_0", 32, 34),
    12: GGUFBlockType("Q4_K", 256, 144), 13: GGUFBlockType("Q5_K", 256, 176), 14: GGUFBlockType("Q6_K", 256, 210),
}
# Values per block of x's int8 rounding (and of the 32-value types): a K-quant super-block is 8 of them.
QK = 32


# From this many rows of x on, the kernel dequantizes tiles of W to f32 and multiplies in f32, and
# the model (jaxlm/models/quantization/gguf.py) uses XLA's dot on W dequantized in XLA instead;
# below, the kernel rounds x to int8 per block and takes integer dot products. With rows of x in
# vector lanes the integer path measured 1.6-10x faster than XLA's dot on dequantized W at
# 16-256 rows, 1.1-3.4x at 512 and 0.98-1.9x at 1024 (SmolLM2's shapes, Xeon with AVX512-VNNI; docs/PERF_NOTES.md,
# session 12), so prefill chunks up to 512 tokens take it too.
F32_MIN_ROWS = 1024


# Every kernel type reaches the kernel with its weight rows interleaved IL at a time
# (gguf_matmul_il.h, gguf_matmul_kil.h spell out the layouts): one 64-byte load then holds 4
# bytes of 16 rows, so one dpbusd advances 16 rows' dot products. A group's block (super-block)
# is its fields one after another, each for the 16 rows in one of three arrangements:
#   "row": each row's n bytes in turn (the f16 scales); "sub": byte j of each row in turn, for j
#   < n (a scale per sub-block); "chunk": 4 bytes of each row in turn, n / 4 times (the values).
# The file's bytes but for Q8_0's q (stored + 128) and Q4_K / Q5_K's packed 6-bit scales and
# mins, unpacked to a byte each (sc, m: 4 bytes more a row and super-block, +2.8% / +2.3%).
IL = 16
_FIELDS = {  # (arrangement, bytes a row) in kernel order
    2: (("row", 2), ("chunk", 16)),
    3: (("row", 2), ("row", 2), ("chunk", 16)),
    8: (("row", 2), ("chunk", 32)),
    12: (("row", 2), ("row", 2), ("sub", 8), ("sub", 8), ("chunk", 128)),
    13: (("row", 2), ("row", 2), ("sub", 8), ("sub", 8), ("chunk", 32), ("chunk", 128)),
    14: (("row", 2), ("sub", 16), ("chunk", 64), ("chunk", 128)),
}


def kernel_type_size(qtype: int) -> int:
    """Bytes a row and block (super-block) of type qtype in the kernel layout."""
    return sum(n for _, n in _FIELDS[qtype])


def kernel_rows(n: int, qtype: int) -> int:
    """Rows of the kernel layout of an [n, ...] tensor of type qtype (groups of IL)."""
    return -(-n // IL)


def kernel_row_bytes(k: int, qtype: int) -> int:
    """Bytes a row of the kernel layout of a tensor with k inputs (a group of IL weight rows)."""
    return k // GGUF_KERNEL_TYPES[qtype].block_size * IL * kernel_type_size(qtype)


def _unpack_scales(s):
    """Q4_K / Q5_K's scales[12] [..., 12] -> (sc, m) [..., 8] each (gguf_kquants.h: scales_mins)."""
    cat = np.concatenate if isinstance(s, np.ndarray) else jnp.concatenate
    s0, s1, s2 = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    return (cat([s0 & 63, (s2 & 15) | ((s0 >> 6) << 4)], axis=-1),
            cat([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], axis=-1))


def _pack_scales(sc, m):
    """(sc, m) [..., 8] -> scales[12] [..., 12]: _unpack_scales' inverse."""
    cat = np.concatenate if isinstance(sc, np.ndarray) else jnp.concatenate
    return cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)


def _file_to_fields(b: np.ndarray, qtype: int) -> list[np.ndarray]:
    """A block's file bytes [..., size] -> its kernel fields [..., n] in kernel order."""
    if qtype == 8:
        return [b[..., :2], b[..., 2:] ^ np.uint8(0x80)]
    if qtype == 2:
        return [b[..., :2], b[..., 2:]]
    if qtype == 3:
        return [b[..., :2], b[..., 2:4], b[..., 4:]]
    if qtype == 14:
        return [b[..., 208:210], b[..., 192:208], b[..., 128:192], b[..., :128]]
    sc, m = _unpack_scales(b[..., 4:16])
    return [b[..., 0:2], b[..., 2:4], sc, m, *([b[..., 16:48]] if qtype == 13 else []), b[..., -128:]]


def _fields_to_file(f: list[jax.Array], qtype: int) -> jax.Array:
    """_file_to_fields' inverse, in XLA: the kernel fields [..., n] -> the file's bytes [..., size]."""
    if qtype == 8:
        f = [f[0], f[1] ^ jnp.uint8(0x80)]
    elif qtype == 14:
        f = f[::-1]
    elif qtype in (12, 13):
        f = [f[0], f[1], _pack_scales(f[2], f[3]), *f[4:]]
    return jnp.concatenate(f, axis=-1)


def to_kernel_layout(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """A tensor's blocks as the file has them, [N, row bytes] uint8, in the kernel's layout
    [ceil(N / 16), 16 * kernel row bytes]: each group of 16 rows (the last padded with zero rows)
    block by block, each block its fields (_FIELDS) for the 16 rows. Host-side, at load."""
    blocks = np.asarray(blocks, np.uint8)
    size = GGUF_KERNEL_TYPES[qtype].type_size
    n, nb = blocks.shape[0], blocks.shape[1] // size
    g = -(-n // IL)
    b = np.zeros((g * IL, nb, size), np.uint8)
    b[:n] = blocks.reshape(n, nb, size)
    b = b.reshape(g, IL, nb, size).transpose(0, 2, 1, 3)  # [group, block, row, bytes]
    parts = []
    for (kind, nbytes), f in zip(_FIELDS[qtype], _file_to_fields(b, qtype)):
        if kind == "sub":
            f = f.swapaxes(-1, -2)
        elif kind == "chunk":
            f = f.reshape(g, nb, IL, nbytes // 4, 4).transpose(0, 1, 3, 2, 4)  # [.., chunk, row, 4]
        parts.append(f.reshape(g, nb, -1))
    return np.concatenate(parts, axis=-1).reshape(g, -1)


def _kernel_fields(w: jax.Array, qtype: int) -> list[jax.Array]:
    """Groups [..., nb * 16 * kernel block bytes] of the kernel layout -> the kernel fields with
    the row in the group as an axis: each [..., nb, 16, n]."""
    g = w.reshape(*w.shape[:-1], -1, IL * kernel_type_size(qtype))
    lead = g.shape[:-1]
    fields, at = [], 0
    for kind, n in _FIELDS[qtype]:
        f = g[..., at:at + IL * n]
        at += IL * n
        if kind == "row":
            f = f.reshape(*lead, IL, n)
        elif kind == "sub":
            f = jnp.swapaxes(f.reshape(*lead, n, IL), -1, -2)
        else:
            f = jnp.swapaxes(f.reshape(*lead, n // 4, IL, 4), -3, -2).reshape(*lead, IL, n)
        fields.append(f)
    return fields


def from_kernel_layout(w: jax.Array, qtype: int, n: int) -> jax.Array:
    """The kernel layout back to the file's blocks [n, row bytes], in XLA (many-rows products)."""
    blocks = _fields_to_file(_kernel_fields(w, qtype), qtype)  # [G, nb, 16, size]
    g = blocks.shape[0]
    return jnp.swapaxes(blocks, 1, 2).reshape(g * IL, -1)[:n]


def kernel_layout_take(w: jax.Array, ids: jax.Array, qtype: int) -> jax.Array:
    """Rows ``ids`` of a tensor in the kernel layout, as the file's blocks [..., row bytes] (the
    embedding's lookup): each id's group gathered, then its row picked out of each field."""
    groups = jnp.take(w, ids // IL, axis=0)  # [..., G bytes]
    lane = (ids % IL)[..., None, None, None]
    fields = [jnp.take_along_axis(f, lane, axis=-2)[..., 0, :] for f in _kernel_fields(groups, qtype)]
    return _fields_to_file(fields, qtype).reshape(*ids.shape, -1)


def gguf_matmul_cpu(x: jax.Array, w: jax.Array, qtype: int, *, n: int | None = None,
                    f32_min_rows: int = F32_MIN_ROWS) -> jax.Array:
    """x [..., K] (cast to f32) @ W^T -> [..., N] f32, W [N, K] given as its GGUF blocks of type
    ``qtype`` (GGUF_KERNEL_TYPES) in the kernel layout (``to_kernel_layout``; ``n``: N, needed
    where the interleaved layout padded it to a multiple of 16). Fewer than ``f32_min_rows`` rows
    of x are rounded to int8 per block of 32 inside (as llama.cpp does); more are multiplied as
    given (0: always rounded). Needs load_cpu_kernels()."""
    if qtype not in GGUF_KERNEL_TYPES:
        raise ValueError(f"gguf_matmul_cpu: GGUF type {qtype} has no kernel (kernel types: "
                         f"{', '.join(t.name for t in GGUF_KERNEL_TYPES.values())})")
    lead, k = x.shape[:-1], x.shape[-1]
    n = n if n is not None else w.shape[0] * IL
    bt = GGUF_KERNEL_TYPES[qtype]
    if k % bt.block_size or w.shape != (kernel_rows(n, qtype), kernel_row_bytes(k, qtype)):
        raise ValueError(f"gguf_matmul_cpu: x [..., {k}] does not match {bt.name} blocks of shape {tuple(w.shape)} "
                         f"for {n} rows ({bt.block_size} values in {bt.type_size} bytes a block, rows interleaved "
                         "by 16: to_kernel_layout)")
    x2 = x.reshape(-1, k).astype(jnp.float32)
    call = jax.ffi.ffi_call("jaxlm_gguf_matmul", jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x2, w, qtype=np.int32(qtype), f32_min_rows=np.int32(f32_min_rows)).reshape(*lead, n)


def _f16(b: jax.Array, lo: int) -> jax.Array:
    """The f16 at bytes lo, lo + 1 of each block, as f32 [..., blocks, 1]."""
    return jax.lax.bitcast_convert_type(b[..., lo:lo + 2], jnp.float16).astype(jnp.float32)[..., None]


def _dequantize_kquant(b: jax.Array, name: str) -> jax.Array:
    """Super-blocks [..., n, bytes] -> [..., n, 256] f32, in the gguf package's order of operations
    (d * sc first, then times q, less dmin * m), so the values are its values exactly."""
    if name == "Q6_K":
        ql, qh, sc = b[..., :128], b[..., 128:192], jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8)
        ql = ql.reshape(*ql.shape[:-1], 2, 1, 64)
        lo = jnp.concatenate([ql & 15, ql >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
        qh = qh.reshape(*qh.shape[:-1], 2, 1, 32)
        hi = jnp.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2).reshape(*b.shape[:-1], 8, 32)
        q = ((lo | (hi << 4)).astype(jnp.int8) - 32).reshape(*b.shape[:-1], 16, 16).astype(jnp.float32)
        return ((_f16(b, 208) * sc.astype(jnp.float32))[..., None] * q).reshape(*b.shape[:-1], 256)
    s = b[..., 4:16]
    s0, s1, s2 = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([s0 & 63, (s2 & 15) | ((s0 >> 6) << 4)], axis=-1).astype(jnp.float32)
    mn = jnp.concatenate([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], axis=-1).astype(jnp.float32)
    qs = b[..., b.shape[-1] - 128:].reshape(*b.shape[:-1], 4, 1, 32)
    q = jnp.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    if name == "Q5_K":
        qh = b[..., 16:48][..., None, :]
        q = q | (jnp.concatenate([(qh >> j) & 1 for j in range(8)], axis=-2) << 4)
    d, dm = (_f16(b, 0) * sc)[..., None], (_f16(b, 2) * mn)[..., None]
    return (d * q.astype(jnp.float32) - dm).reshape(*b.shape[:-1], 256)


def gguf_dequantize_rows(rows: jax.Array, qtype: int) -> jax.Array:
    """Blocks [..., K / block values * block bytes] uint8 -> values [..., K] f32, in XLA (any
    platform): the embedding's gathered rows, and W for many rows (prefill). The formulas are the
    C++ kernel's (gguf_matmul.cc's and gguf_kquants.h's headers)."""
    name, _, size = GGUF_KERNEL_TYPES[qtype]
    lead = rows.shape[:-1]
    b = rows.reshape(*lead, -1, size)
    f16 = functools.partial(_f16, b)
    if name.endswith("_K"):
        vals = _dequantize_kquant(b, name)
    elif name == "Q8_0":
        vals = f16(0) * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    else:
        qs = b[..., size - QK // 2:]
        nib = jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.float32)
        vals = f16(0) * (nib - 8.0) if name == "Q4_0" else f16(0) * nib + f16(2)
    return vals.reshape(*lead, -1)


def dequantize_reference(w: np.ndarray, qtype: int, k: int) -> np.ndarray:
    """W [N, K] float32 from its blocks, by the ``gguf`` package's dequantizer."""
    import gguf

    return gguf.quants.dequantize(np.asarray(w, np.uint8), gguf.GGMLQuantizationType(qtype)).reshape(-1, k)


def quantize_rows_reference(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the kernel sees it: each block of 32 rounded to int8 times max|x| / 127."""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, QK)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.round(xb * inv) * d).reshape(x.shape).astype(np.float32)


def gguf_matmul_reference(x: np.ndarray, w: np.ndarray, qtype: int, *, quantize_x: bool = False) -> np.ndarray:
    """The NumPy oracle: dequantize W, then a float64 matmul. quantize_x: x rounded as the
    kernel rounds it first (isolates the kernel's arithmetic from the int8 activations)."""
    x = np.asarray(x, np.float32)
    if quantize_x:
        x = quantize_rows_reference(x)
    wf = dequantize_reference(w, qtype, x.shape[-1])
    return (x.astype(np.float64) @ wf.astype(np.float64).T).astype(np.float32)
