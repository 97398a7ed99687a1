"""PEFT LoRA directories: find them, check them against a model, read their matrices.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, per adapted module,
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]. The
delta is ``x @ A.T @ B.T * scale``, scale = alpha / r (alpha / sqrt(r) under rsLoRA), with r and
alpha per module when ``rank_pattern`` / ``alpha_pattern`` say so.

``check_adapter`` reads the config and the safetensors header only (no tensor data), and is what
admission runs: every problem is a ``LoRAAdapterError`` naming it. ``load_adapter`` then reads
the matrices, laid out for the slots: A as [in, r], B as [r, out] with the scale folded in.
No jax here: the front end checks adapters before anything reaches an engine core.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np

from jaxlm.lora.errors import LoRAAdapterError
from jaxlm.lora.targets import LoRATarget, LoRATargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class AdapterModule:
    """One adapted PEFT module: its rank, its scale, and where its B columns go."""

    rank: int
    scale: float
    parts: tuple[tuple[LoRATarget, int, int], ...]


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its resolved directory and its modules by PEFT module path."""

    name: str
    path: str
    modules: dict[str, AdapterModule]

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def resolve_adapter_path(name: str, path: str) -> str:
    """A local directory for ``path``: itself, or ``org/name`` in the local Hugging Face cache."""
    from jaxlm.model_loader.errors import NoWeightsError
    from jaxlm.model_loader.hf_cache import hf_hub_cache_dir, resolve_model_path

    if not path:
        raise LoRAAdapterError(name, "no lora_path given")
    try:
        local = resolve_model_path(path)
    except NoWeightsError:
        raise LoRAAdapterError(name, f"{_short(path)} is neither a local directory nor in the local Hugging Face cache "
                                     f"({hf_hub_cache_dir()}; jaxlm never downloads)") from None
    if not os.path.isdir(local):
        raise LoRAAdapterError(name, f"{_short(path)} is not a directory (a PEFT adapter is a directory holding "
                                     f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    return local


def _short(path: str, limit: int = 200) -> str:
    """A path for an error message (a hostile one may be megabytes long)."""
    return repr(path) if len(path) <= limit else repr(path[:limit]) + f"... ({len(path)} characters)"


def read_peft_config(name: str, path: str) -> dict[str, Any]:
    """The adapter's config, refused unless it is a plain LoRA jaxlm can serve."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoRAAdapterError(name, f"no {CONFIG_FILE} in {path}")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(name, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(name, f"{CONFIG_FILE} must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(name, f"PEFT type {peft_type!r} is not supported (only LORA adapters)")
    refused = {
        "use_dora": "DoRA adapters (use_dora) are not supported",
        "lora_bias": "LoRA biases (lora_bias) are not supported",
        "modules_to_save": "modules_to_save (fully trained extra layers) are not supported",
        "layer_replication": "layer_replication is not supported",
        "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
        "use_qalora": "QA-LoRA (use_qalora) is not supported",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise LoRAAdapterError(name, why)
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(name, f"bias={cfg['bias']!r} is not supported (only 'none')")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(name, f"r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAAdapterError(name, f"lora_alpha must be a finite number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise LoRAAdapterError(name, f"{key} must be a JSON object")
    return cfg


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: a key matches a module path's suffix."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_target_modules(name: str, cfg: dict[str, Any], targets: LoRATargets) -> None:
    wanted = cfg.get("target_modules")
    if wanted is None or isinstance(wanted, str):  # None: PEFT's defaults; str: a regex over paths
        return
    if not isinstance(wanted, list) or not all(isinstance(m, str) for m in wanted):
        raise LoRAAdapterError(name, f"target_modules must be a list of module names, got {wanted!r}")
    known = targets.short_names()
    for module in wanted:
        if module.rsplit(".", 1)[-1] not in known:
            raise LoRAAdapterError(
                name, f"target module {module!r} is not a layer of this model ({targets.architecture}); "
                      f"adaptable modules: {', '.join(sorted(known))}")


def _tensor_shapes(name: str, path: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        other = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.isfile(os.path.join(path, f))]
        hint = f" ({other[0]} is there: convert it to safetensors)" if other else ""
        raise LoRAAdapterError(name, f"no {WEIGHTS_FILE} in {path}{hint}")
    try:
        with safe_open(file, framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file
        raise LoRAAdapterError(name, f"{WEIGHTS_FILE} cannot be read: {e}") from None


def check_adapter(name: str, lora_path: str, targets: LoRATargets, max_lora_rank: int) -> AdapterSpec:
    """The adapter's spec, or LoRAAdapterError naming what makes it unusable on this model."""
    path = resolve_adapter_path(name, lora_path)
    cfg = read_peft_config(name, path)
    _check_target_modules(name, cfg, targets)
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in _tensor_shapes(name, path).items():
        match = _KEY.match(key.removeprefix(_PREFIX))
        if match is None:
            raise LoRAAdapterError(name, f"tensor {key!r} is not a LoRA A/B matrix (embedding LoRA, DoRA "
                                         "magnitudes and saved modules are not supported)")
        pairs.setdefault(match["module"], {})[match["which"]] = shape
    if not pairs:
        raise LoRAAdapterError(name, f"{WEIGHTS_FILE} holds no LoRA matrices")
    alpha, use_rslora = cfg.get("lora_alpha", cfg["r"]), bool(cfg.get("use_rslora", False))
    modules = {}
    for module, ab in sorted(pairs.items()):
        modules[module] = _check_module(name, module, ab, targets, max_lora_rank,
                                        _pattern_value(cfg.get("alpha_pattern") or {}, module, alpha), use_rslora)
    return AdapterSpec(name, path, modules)


def _check_module(name: str, module: str, ab: dict[str, tuple[int, ...]], targets: LoRATargets,
                  max_lora_rank: int, alpha: float, use_rslora: bool) -> AdapterModule:
    if set(ab) != {"A", "B"}:
        missing = "lora_B" if "A" in ab else "lora_A"
        raise LoRAAdapterError(name, f"{module} has no {missing}.weight")
    parts = targets.resolve(module)
    if parts is None:
        raise LoRAAdapterError(name, f"module {module!r} is not an adaptable layer of this model "
                                     f"({targets.architecture})")
    a, b = ab["A"], ab["B"]
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        raise LoRAAdapterError(name, f"{module}: lora_A {list(a)} and lora_B {list(b)} are not [r, in] and [out, r]")
    rank = int(a[0])
    if rank > max_lora_rank:
        raise LoRAAdapterError(name, f"LoRA rank {rank} of {module} is greater than max_lora_rank {max_lora_rank}")
    want_in, want_out = parts[0][0].in_features, parts[-1][2]
    if a[1] != want_in or b[0] != want_out:
        raise LoRAAdapterError(
            name, f"{module}: lora_A {list(a)} / lora_B {list(b)} do not fit the layer's {want_in} inputs and "
                  f"{want_out} outputs: the adapter was trained for a base model of another shape")
    scale = float(alpha) / (math.sqrt(rank) if use_rslora else rank)
    return AdapterModule(rank, scale, tuple(parts))


def load_adapter(spec: AdapterSpec, dtype: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """target path -> (A [in, r], B [r, out] * scale) in ``dtype`` (host arrays)."""
    from safetensors import safe_open

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    dtype = np.dtype(dtype)
    try:
        with safe_open(os.path.join(spec.path, WEIGHTS_FILE), framework="numpy") as f:
            keys = {k.removeprefix(_PREFIX): k for k in f.keys()}
            for module, m in spec.modules.items():
                a = f.get_tensor(keys[f"{module}.lora_A.weight"]).astype(np.float32).T
                b = f.get_tensor(keys[f"{module}.lora_B.weight"]).astype(np.float32).T * m.scale
                if not (np.isfinite(a).all() and np.isfinite(b).all()):
                    raise LoRAAdapterError(spec.name, f"{module} holds NaN or infinite values")
                for target, start, stop in m.parts:
                    if target.path in out:
                        raise LoRAAdapterError(spec.name, f"{target.path} is adapted twice")
                    out[target.path] = (np.ascontiguousarray(a, dtype), np.ascontiguousarray(b[:, start:stop], dtype))
    except (OSError, KeyError) as e:
        raise LoRAAdapterError(spec.name, f"reading {WEIGHTS_FILE} failed: {e}") from None
    return out
