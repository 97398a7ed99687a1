"""What every config module shares: the cache root, the CLI value parsers, ``arg``.

Light on purpose: importing it must not import jax (the server's --help reads it)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable


# Canonical dtypes, then vLLM's aliases for them.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ("auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "orbax")
ATTENTION_BACKENDS = ("auto", "xla", "pallas", "cpu")
# vLLM's --kv-cache-dtype values (auto: the model's dtype; fp8 = fp8_e4m3).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's --quantization names jaxlm serves (jaxlm/models/quantization/registry.py holds the configs).
# gguf: a GGUF file's block types kept as they are; "none" (jaxlm's, not vLLM's): a GGUF file
# dequantized to float at load (the float path, for A/B runs).
QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors", "gguf", "none")


def jaxlm_cache_root() -> str | None:
    """The one cache root: $JAXLM_CACHE_DIR ("" = no caches), else $XDG_CACHE_HOME/jaxlm,
    else ~/.cache/jaxlm. The compilation cache (``xla/``) and GGUF tokenizers live under it."""
    root = os.environ.get("JAXLM_CACHE_DIR")
    if root is not None:
        return root or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxlm")


# ---- parsers for CLI values (vLLM's spellings) ---------------------------------------------

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """``32k`` = 32000, ``32K`` = 32768 (lower case decimal, upper case binary, as vLLM)."""
    text = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if not match:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer (suffixes: k/m/g = 10^3.., K/M/G = 2^10..)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ValueError(f"{text!r}: no decimals with binary suffixes like {suffix}; "
                         f"did you mean {number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


def parse_bytes(text: str) -> int:
    """A byte count: ``4000000000``, ``1e9``, ``4GiB``/``4G`` (binary), ``4GB``/``4g`` (decimal)."""
    text = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?(?:[eE]\d+)?)\s*([kKmMgGtT])?(i?[bB])?", text)
    if not match:
        raise ValueError(f"{text!r} is not a byte count (e.g. 4000000000, 1e9, 4GiB, 4GB)")
    number, suffix, unit = match.groups()
    if suffix is None:
        value = float(number)
        if value != int(value):
            raise ValueError(f"{text!r} is not a whole number of bytes")
        return int(value)
    if unit is None:  # bare suffix: vLLM's human_readable_int
        return human_readable_int(number + suffix)
    scale = _BINARY[suffix.upper()] if unit.lower() == "ib" else _DECIMAL[suffix.lower()]
    return int(float(number) * scale)


def parse_int_list(text: str) -> list[int]:
    """``16,32,64`` → [16, 32, 64]."""
    return [int(x) for x in str(text).split(",") if x.strip()]


def parse_token_buckets(text: str) -> list[int] | str:
    """``16,32,64`` → [16, 32, 64]; ``auto`` stays "auto" (derived from --workload at start-up)."""
    return "auto" if str(text).strip() == "auto" else parse_int_list(text)


def parse_json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def parse_json_list(text: str) -> list[Any]:
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError(f"expected a JSON list, got {text!r}")
    return value


def arg(default: Any = None, help: str = "", *, choices: tuple[str, ...] | None = None,
        parse: Callable[[str], Any] | None = None, flags: tuple[str, ...] = (),
        nargs: str | None = None) -> Any:
    """A config field that is also an engine argument (``--field-name`` plus ``flags``)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "parse": parse, "flags": flags, "nargs": nargs})
