"""Helpers shared by the loader tests (a unique module name: conftest clashes across test dirs)."""

from __future__ import annotations

import os

import numpy as np
from flax import nnx

from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import get_model, resolve_model_config


def load(path: str, load_format: str = "auto", **model_kw) -> nnx.Module:
    lc = LoadConfig(load_format=load_format)
    mc = resolve_model_config(ModelConfig(model=path, **model_kw), lc)
    return get_model(mc, lc, attn_backend=None)


def param_as_hf(model: nnx.Module, hf_name: str) -> np.ndarray:
    """A loaded Param in the checkpoint's (HF) layout, looked up by its HF name."""
    node = model
    for part in hf_name.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    value = np.asarray(node[...])
    if node.get_metadata().get("hf_layout") == "transpose":
        value = value.T
    return value


def hf_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of an HF checkpoint directory, read with the safetensors library itself."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out
