"""Quantized tiny checkpoints written by the tests themselves from known float weights.

``write_quantized(float_dir, fmt, out_dir, ref_dir)`` quantizes every decoder Linear (MoE experts
included, each expert's separately) of a tiny float checkpoint the way the format's quantizer stores it (written here from each format's
description: AutoAWQ's GEMM packing, AutoGPTQ's v1 packing, compressed-tensors' pack-quantized
and float-quantized layouts, vLLM's per-tensor fp8), and writes beside it a float checkpoint
holding the dequantized weights: the reference transformers runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMATS = ("fp8", "ct-fp8-channel", "ct-w4a16", "ct-w8a16", "awq", "gptq")
# The decoder's Linears, an MoE layer's per-expert ones (Mixtral's w1/w3/w2 too) and its shared
# expert's included; routers (mlp.gate, shared_expert_gate) stay float, as quantizers leave them.
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.|experts\.\d+\.)?"
                     r"(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
# An fp8 checkpoint's static activation scales (activation_scheme: static), one per Linear.
INPUT_SCALE = 0.0625
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """uint values packed 32/bits per int32 along ``axis``; value ``order[i]`` of a run in bits
    ``bits * i`` (sequential by default)."""
    pf = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // pf, pf)
    order = order or tuple(range(pf))
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(pf):
        words |= v[..., order[i]] << np.uint32(bits * i)
    return np.moveaxis(words.view(np.int32), -1, axis)


def _fp8(w: np.ndarray, per_channel: bool):
    amax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max()
    scale = (np.maximum(amax, 1e-12) / 448.0).astype(np.float32)
    q = torch.from_numpy(np.clip(w / scale, -448, 448).astype(np.float32)).to(torch.float8_e4m3fn)
    return q, torch.from_numpy(np.asarray(scale, np.float32)), q.float().numpy() * scale


def _sym_int(w: np.ndarray, bits: int, group: int):
    """Symmetric: s = amax / (2**(bits-1) - 1) per (out, group); q in [-2**(bits-1), 2**(bits-1) - 1]."""
    out, inp = w.shape
    g = inp if group == -1 else group
    wg = w.reshape(out, inp // g, g)
    qmax = 2 ** (bits - 1) - 1
    s = (np.maximum(np.abs(wg).max(axis=2, keepdims=True), 1e-8) / qmax).astype(np.float32)
    q = np.clip(np.round(wg / s), -qmax - 1, qmax)
    return q.reshape(out, inp).astype(np.int64), s[..., 0], (q * s).reshape(out, inp)


def _asym_int4(w: np.ndarray, group: int):
    """AWQ/GPTQ style: per (group, out) of W^T [in, out], fp16 scale and integer zero in [0, 15]."""
    wt = w.T  # [in, out]
    inp, out = wt.shape
    wg = wt.reshape(inp // group, group, out)
    lo, hi = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
    s = np.maximum((hi - lo) / 15, 1e-8).astype(np.float16).astype(np.float32)  # as the checkpoint stores it
    z = np.clip(np.round(-lo / s), 0, 15)
    q = np.clip(np.round(wg / s[:, None]) + z[:, None], 0, 15)
    deq = ((q - z[:, None]) * s[:, None]).reshape(inp, out).T
    return q.reshape(inp, out).astype(np.uint32), s, z.astype(np.uint32), deq


def _quantize(name: str, w: np.ndarray, fmt: str, group: int) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    base = name[: -len(".weight")]
    if fmt in ("fp8", "fp8-static", "ct-fp8-channel"):
        q, scale, deq = _fp8(w, per_channel=fmt == "ct-fp8-channel")
        scale = scale.reshape(-1, 1) if fmt == "ct-fp8-channel" else scale.reshape(())
        tensors = {f"{base}.weight": q, f"{base}.weight_scale": scale}
        if fmt == "fp8-static":
            tensors[f"{base}.input_scale"] = torch.tensor(INPUT_SCALE, dtype=torch.float32)
        return tensors, deq
    if fmt in ("ct-w4a16", "ct-w8a16"):
        bits = 4 if fmt == "ct-w4a16" else 8
        q, s, deq = _sym_int(w, bits, group if bits == 4 else -1)
        packed = _pack((q + 2 ** (bits - 1)).astype(np.uint32), bits, axis=1)
        return {f"{base}.weight_packed": torch.from_numpy(packed), f"{base}.weight_scale": torch.from_numpy(s),
                f"{base}.weight_shape": torch.tensor(w.shape, dtype=torch.int64)}, deq
    q, s, z, deq = _asym_int4(w, group)
    if fmt == "awq":
        tensors = {"qweight": _pack(q, 4, axis=1, order=AWQ_ORDER), "qzeros": _pack(z, 4, axis=1, order=AWQ_ORDER)}
    else:  # gptq v1: zeros stored minus one
        tensors = {"qweight": _pack(q, 4, axis=0), "qzeros": _pack(z - 1, 4, axis=1),
                   "g_idx": (np.arange(w.shape[1]) // group).astype(np.int32)}
    out = {f"{base}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
    out[f"{base}.scales"] = torch.from_numpy(s.astype(np.float16))
    return out, deq


def quantization_config(fmt: str, group: int) -> dict:
    if fmt in ("fp8", "fp8-static"):
        return {"quant_method": "fp8", "activation_scheme": "static" if fmt == "fp8-static" else "dynamic"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq"}
    if fmt == "ct-fp8-channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        ct_format = "float-quantized"
    else:
        bits = 4 if fmt == "ct-w4a16" else 8
        weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False,
                   "strategy": "group" if bits == 4 else "channel", "group_size": group if bits == 4 else None}
        acts, ct_format = None, "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": ct_format, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights, "input_activations": acts, "format": ct_format}}}


def write_quantized(float_dir: str, fmt: str, out_dir: str, ref_dir: str, group: int = 128,
                    config_overrides: dict | None = None) -> tuple[str, str]:
    """(quantized checkpoint, float checkpoint of its dequantized weights)."""
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    quant, ref = {}, {}
    for name, t in tensors.items():
        if _LINEAR.match(name):
            q, deq = _quantize(name, t.float().numpy(), fmt, group)
            quant.update(q)
            ref[name] = torch.from_numpy(np.ascontiguousarray(deq, np.float32))
        else:
            quant[name] = ref[name] = t
    for d, ts in ((out_dir, quant), (ref_dir, ref)):
        shutil.copytree(float_dir, d, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in ts.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**quantization_config(fmt, group), **(config_overrides or {})}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir, ref_dir


def fp8_per_channel_reference(float_dir: str, ref_dir: str) -> str:
    """The float checkpoint with each decoder Linear as online fp8 stores it (per output channel)."""
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    ref = {n: (torch.from_numpy(_fp8(t.float().numpy(), True)[2].astype(np.float32)) if _LINEAR.match(n) else t)
           for n, t in tensors.items()}
    shutil.copytree(float_dir, ref_dir, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(ref_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return ref_dir
