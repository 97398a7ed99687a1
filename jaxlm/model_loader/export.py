"""Write HF-named weights as a transformers-style safetensors directory (e.g. GGUF → HF)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxlm.model_loader.formats import SAFETENSORS_INDEX
from jaxlm.model_loader.safetensors_utils import write_safetensors

logger = logging.getLogger(__name__)


def export_safetensors(
    weights: Iterable[tuple[str, np.ndarray]],
    out_dir: str,
    hf_config: Any,
    *,
    tokenizer: Any = None,
    dtype: Any = None,
    max_shard_bytes: int = 2 << 30,
) -> list[str]:
    """Stream ``weights`` into shards of at most ``max_shard_bytes`` (+ index when sharded).

    Only one shard is held in memory at a time. Returns the shard file paths.
    """
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    files: list[str] = []
    weight_map: dict[str, int] = {}

    def flush() -> None:
        idx = len(files)
        path = os.path.join(out_dir, f"model-{idx:05d}.safetensors")
        write_safetensors(path, shards[-1], {"format": "pt"})
        files.append(path)
        shards[-1] = {}

    for name, arr in weights:
        arr = np.ascontiguousarray(arr if dtype is None else arr.astype(dtype))
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][name] = arr
        weight_map[name] = len(files)
        size += arr.nbytes
    flush()
    if len(files) == 1:
        final = os.path.join(out_dir, "model.safetensors")
        os.replace(files[0], final)
        files = [final]
    else:
        n = len(files)
        renamed = []
        for i, f in enumerate(files):
            new = os.path.join(out_dir, f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            os.replace(f, new)
            renamed.append(new)
        files = renamed
        index = {"metadata": {}, "weight_map": {k: os.path.basename(files[v]) for k, v in weight_map.items()}}
        with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as fh:
            json.dump(index, fh, indent=1)
    hf_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    logger.info("wrote %d tensor(s) in %d file(s) to %s", len(weight_map), len(files), out_dir)
    return files
