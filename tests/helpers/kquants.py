"""A NumPy encoder for GGUF's K-quants (Q4_K, Q5_K, Q6_K) in llama.cpp's byte layout, for tests.

The ``gguf`` package (0.19) dequantizes the K-quants but cannot quantize them. This encoder picks
each sub-block's scale (and Q4_K/Q5_K's min) from its range, without llama.cpp's search for the
best scales: valid blocks, a little less accurate than llama.cpp's. ``quantize_kquant`` returns
the blocks and the values they encode, computed here in the gguf dequantizer's order of
operations, so a test can hold the layout to gguf's dequantizer exactly.

    blocks, values = quantize_kquant(w, gguf.GGMLQuantizationType.Q4_K)   # w [..., K], K % 256 == 0
"""

from __future__ import annotations

import gguf
import numpy as np

QK_K = 256
_Q = gguf.GGMLQuantizationType


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [n, 8] -> scales[12] [n, 12] (get_scale_min's inverse)."""
    s = np.zeros((sc.shape[0], 12), np.uint8)
    s[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return s


def _encode_min_type(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K (bits 4) / Q5_K (bits 5): x [n, 256] -> blocks [n, 144 | 176], values [n, 256]."""
    n, qmax = x.shape[0], (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # w = d sc q - dmin m with q, sc, m >= 0
    scale, mins = (sub.max(-1) - lo) / qmax, -lo
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(mins.max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(_safe_div(scale, df)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(mins, dminf)), 0, 63).astype(np.uint8)
    ds, dm = (df * sc.astype(np.float32))[..., None], (dminf * mn.astype(np.float32))[..., None]
    q = np.clip(np.round(_safe_div(sub + dm, ds)), 0, qmax).astype(np.uint8)  # [n, 8, 32]
    values = (ds * q.astype(np.float32) - dm).reshape(n, QK_K)
    qs = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)  # [n, 4, 32]: sub-blocks 2i and 2i + 1
    parts = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), _pack_scales(sc, mn)]
    if bits == 5:
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=1))
    parts.append(qs.reshape(n, 128))
    return np.concatenate(parts, axis=1), values


def _encode_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n, 256] -> blocks [n, 210], values [n, 256]: w = d scale (q - 32), a scale per 16."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(_safe_div(scale, df)), -128, 127).astype(np.int8)
    ds = (df * sc.astype(np.float32))[..., None]
    q = (np.clip(np.round(_safe_div(sub, ds)), -32, 31) + 32).astype(np.uint8)  # [n, 16, 16]
    values = (ds * (q.astype(np.int8) - np.int8(32)).astype(np.float32)).reshape(n, QK_K)
    q = q.reshape(n, 2, 4, 32)  # value 128 h + 32 t + l
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                        axis=-1)  # [n, 2, 64]: ql[64 h + 32 (t % 2) + l] holds t and t + 2
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2)  # [n, 2, 32]
    blocks = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)],
                            axis=1)
    return blocks, values


def quantize_kquant(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K] (K a multiple of 256) -> (blocks [..., K / 256 * block bytes] uint8, the float32
    values those blocks encode [..., K])."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows of whole super-blocks of {QK_K} values, got {w.shape[-1]}")
    x = w.reshape(-1, QK_K)
    if qtype == _Q.Q4_K:
        blocks, values = _encode_min_type(x, 4)
    elif qtype == _Q.Q5_K:
        blocks, values = _encode_min_type(x, 5)
    elif qtype == _Q.Q6_K:
        blocks, values = _encode_q6_k(x)
    else:
        raise ValueError(f"not a K-quant this encoder writes: {qtype.name}")
    return blocks.reshape(*w.shape[:-1], -1), values.reshape(w.shape)


def quantize(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """``gguf.quants.quantize`` with the K-quants added (their blocks from quantize_kquant)."""
    if qtype in (_Q.Q4_K, _Q.Q5_K, _Q.Q6_K):
        return quantize_kquant(w, qtype)[0]
    return gguf.quants.quantize(w, qtype)
