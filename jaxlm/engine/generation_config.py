"""The model's generation_config.json: extra eos ids, and default sampling (vLLM's --generation-config)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from jaxlm.config import ModelConfig

logger = logging.getLogger(__name__)

# Fields of generation_config.json that become SamplingParams defaults (vLLM's list).
DEFAULT_SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
# transformers' GenerationConfig defaults: vLLM reads the file through to_diff_dict(), which drops
# values equal to them (a file's "top_k": 50 is not applied).
_HF_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


def _read_json(directory: str | None) -> dict[str, Any]:
    if not directory or not os.path.isdir(directory):
        return {}  # a .gguf file, an orbax checkpoint without one: no generation config
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def try_get_generation_config(model_config: ModelConfig) -> dict[str, Any]:
    """generation_config.json of the model ("auto", "vllm") or of the directory given instead."""
    source = model_config.generation_config
    if source in ("auto", "vllm"):
        return _read_json(model_config.model)
    if not os.path.isdir(source):
        raise ValueError(f"--generation-config {source!r} is neither 'auto', 'vllm' nor a directory")
    return _read_json(source)


def get_diff_sampling_param(model_config: ModelConfig, generation_config: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams defaults the model's creator recommends (request fields override them).

    "vllm" ignores the file; --override-generation-config applies on top either way (vLLM's rule).
    """
    config = {} if model_config.generation_config == "vllm" else {
        k: v for k, v in generation_config.items() if k not in _HF_DEFAULTS or v != _HF_DEFAULTS[k]}
    config.update(model_config.override_generation_config or {})
    return {k: config[k] for k in DEFAULT_SAMPLING_FIELDS if config.get(k) is not None}


def generation_eos_token_ids(generation_config: dict[str, Any], hf_config: Any) -> set[int]:
    """eos ids of generation_config.json and of the model config (either may list several)."""
    ids: set[int] = set()
    for source in (generation_config.get("eos_token_id"), getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return ids
