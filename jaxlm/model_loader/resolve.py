"""ModelConfig resolution: which model, which format, its HF config, dtype and max length."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.config.utils import QUANTIZATION_METHODS
from jaxlm.model_loader.errors import CorruptCheckpointError, NoWeightsError, UnsupportedModelError
from jaxlm.model_loader.formats import default_model_path, detect_load_format, find_gguf_file, model_dir
from jaxlm.model_loader.hf_cache import resolve_model_path
from jaxlm.models.registry import text_model_config, unsupported_architecture

logger = logging.getLogger(__name__)

# max_model_len when none is asked for: the model's maximum, capped at this on CPU.
_CPU_DEFAULT_MAX_LEN = 2048
_JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def load_hf_config(path: str, load_format: str) -> Any:
    """The transformers config for a checkpoint path of a known format."""
    if load_format == "gguf":
        from jaxlm.model_loader.gguf_utils import gguf_hf_config, open_gguf

        gguf_path = find_gguf_file(path)
        return gguf_hf_config(open_gguf(gguf_path), gguf_path)
    from transformers import AutoConfig

    directory = model_dir(path)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise NoWeightsError(directory, "no config.json next to the weights")
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except ValueError as e:  # unknown model_type, bad JSON
        raise CorruptCheckpointError(os.path.join(directory, "config.json"), str(e)) from e


def _config_dtype(hf_config: Any) -> str | None:
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if dt is None:
        return None
    name = str(dt).removeprefix("torch.")
    return name if name in _JAX_DTYPES else None


def resolve_dtype(dtype: str, hf_config: Any, platform: str | None = None) -> str:
    """``auto`` → float32 on CPU, the checkpoint's dtype (bf16 if unknown) on accelerators."""
    # XLA:CPU runs bf16 matmuls ~10-15x slower than f32 here (no avx512_bf16).
    if dtype != "auto":
        return dtype
    platform = platform or jax.default_backend()
    if platform == "cpu":
        return "float32"
    return _config_dtype(hf_config) or "bfloat16"


def resolve_max_model_len(requested: int | None, hf_config: Any, platform: str | None = None) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None)
    platform = platform or jax.default_backend()
    if requested is None:
        if model_max is None:
            return _CPU_DEFAULT_MAX_LEN
        return min(model_max, _CPU_DEFAULT_MAX_LEN) if platform == "cpu" else int(model_max)
    if requested <= 0:
        raise ValueError(f"max_model_len must be positive, got {requested}")
    if model_max is not None and requested > model_max:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's maximum context "
            f"(max_position_embeddings={model_max})"
        )
    return int(requested)


def resolve_model_config(model_config: ModelConfig, load_config: LoadConfig) -> ModelConfig:
    """A copy of ``model_config`` with a local model path (``org/name`` looked up in the HF cache),
    hf_config, concrete dtype and max_model_len; ``served_model_name`` defaults to the model
    string the user gave, as in vLLM."""
    # ModelConfig.revision is optional here: the config dataclass may not carry it yet.
    revision = getattr(model_config, "revision", None)
    if model_config.model is None:
        path = default_model_path()
    else:
        path = resolve_model_path(model_config.model, revision)
    served = model_config.served_model_name
    if served is None and model_config.model is not None:
        served = [model_config.model]
    load_format = detect_load_format(path, load_config.load_format)
    hf_config = model_config.hf_config if model_config.hf_config is not None else load_hf_config(path, load_format)
    # Before any other field is read: an unsupported family's config (LLaVA's, BLIP-2's) may lack
    # what every supported one has (vocab_size at the top level).
    if (why := unsupported_architecture(hf_config)) is not None:
        raise UnsupportedModelError(path, why)
    hf_config = text_model_config(hf_config)  # a multimodal checkpoint served for text: its text_config
    resolved = dataclasses.replace(
        model_config,
        model=path,
        served_model_name=served,
        hf_config=hf_config,
        dtype=resolve_dtype(model_config.dtype, hf_config),
        max_model_len=resolve_max_model_len(model_config.max_model_len, hf_config),
        quantization=model_config.quantization or _default_quantization(hf_config),
    )
    logger.info(
        "model %s (%s, %s): dtype %s, max_model_len %d, quantization %s",
        path, load_format, type(hf_config).__name__, resolved.dtype, resolved.max_model_len,
        resolved.quantization or "none",
    )
    return resolved


def _default_quantization(hf_config) -> str | None:
    """The checkpoint's own method, as vLLM takes it: a GGUF file is served in its blocks
    (``gguf``; ``--quantization none`` dequantizes it at load)."""
    return checkpoint_quant_method(hf_config)


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """The ``quant_method`` of a checkpoint's ``quantization_config`` (vLLM's spelling), if any;
    checked against the supported ones when the model is built (models/quantization/registry.py)."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    method = raw.get("quant_method") if isinstance(raw, dict) else getattr(raw, "quant_method", None)
    method = getattr(method, "value", method)  # transformers may hold an enum
    if not method:
        return None
    name = str(method).lower().replace("_", "-")
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"the checkpoint's quantization method {name!r} is not supported by jaxlm; "
                         f"supported: {', '.join(sorted(QUANTIZATION_METHODS))}")
    return name


def get_jax_dtype(model_config: ModelConfig) -> Any:
    """The jnp dtype weights are placed in (``auto`` resolved as resolve_model_config does)."""
    dtype = model_config.dtype
    if dtype == "auto":
        dtype = resolve_dtype(dtype, model_config.hf_config)
    return _JAX_DTYPES[dtype]
