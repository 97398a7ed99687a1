"""CompilationConfig: the AOT-compiled step programs and their on-disk cache."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxlm.config.utils import arg, jaxlm_cache_root, parse_int_list, parse_token_buckets

# vLLM's CUDAGraphMode names; jaxlm maps each onto XLA's command buffers (CUDA graphs) per step
# program on a GPU (worker/command_buffers.py). None: XLA's own default command buffers.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILATION_CONFIG_KEYS = ("cudagraph_mode",)


def resolve_compilation_config(value: Any) -> dict[str, Any]:
    """vLLM's `compilation_config` (-O): a dict or its JSON, or an optimization level 0-3 (-O3).
    Level 0 means no CUDA graphs (cudagraph_mode NONE); 1-3 change nothing here, XLA compiles
    every program whole. Returns {"cudagraph_mode": ...} or {}; ValueError naming the field."""
    if isinstance(value, str):
        text = value.strip()
        value = int(text) if text.isdigit() else json.loads(text) if text else {}
    if isinstance(value, bool) or not isinstance(value, (int, dict)):
        raise ValueError(f"compilation_config must be a JSON object or a level 0-3, got {value!r}")
    if isinstance(value, int):
        if value not in range(4):
            raise ValueError(f"compilation_config level must be 0, 1, 2 or 3, got {value}")
        return {"cudagraph_mode": "NONE"} if value == 0 else {}
    unknown = sorted(set(value) - set(COMPILATION_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"compilation_config: unknown key(s) {', '.join(map(repr, unknown))}; jaxlm's keys: "
                         f"{', '.join(COMPILATION_CONFIG_KEYS)} (bucket sizes: --token-buckets, --seq-buckets)")
    out = dict(value)
    if out.get("cudagraph_mode") is not None:
        out["cudagraph_mode"] = check_cudagraph_mode(out["cudagraph_mode"])
    return out


def check_cudagraph_mode(mode: Any) -> str:
    name = mode.upper() if isinstance(mode, str) else mode
    if name not in CUDAGRAPH_MODES:
        raise ValueError(f"compilation_config.cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                         f"got {mode!r}")
    return name


def parse_compilation_config(text: str) -> dict[str, Any]:
    """The -O / --compilation-config value (see resolve_compilation_config)."""
    try:
        return resolve_compilation_config(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"compilation_config is not valid JSON ({e}): {text!r}") from None


@dataclasses.dataclass
class CompilationConfig:
    """The AOT-compiled step programs and their on-disk cache."""

    token_buckets: list[int] | str | None = arg(
        None, "comma-separated padded token counts of a step (default: powers of two up to the budget); "
              "auto = derived, with --seq-buckets, from a simulation of the scheduler on --workload",
        parse=parse_token_buckets)
    seq_buckets: list[int] | None = arg(
        None, "comma-separated padded sequence counts sampled in a step (default: powers of two)",
        parse=parse_int_list)
    workload: str | None = arg(
        None, "the traffic --token-buckets auto is derived from: a JSONL of prompts (optional "
              "output_len), a ShareGPT JSON file, or synthetic[:num=N,prompt=A-B,output=C-D]")
    max_programs: int = arg(40, "most programs --token-buckets auto may compile")
    defer_program_load: bool = arg(
        False, "a warm start loads its compiled programs from the cache on first use and while the "
               "engine idles, not all before serving (on by default for python -m jaxlm.serve)")
    compile_in_background: bool = arg(
        False, "a cold start compiles the largest buckets' programs, starts serving, and compiles the "
               "others in a thread while it serves, each used once compiled (on by default for "
               "python -m jaxlm.serve)")
    compilation_config: dict[str, Any] | None = arg(
        None, "vLLM's -O: a JSON object, e.g. '{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}', or a level 0-3 "
              f"(-O0: no graphs). cudagraph_mode ({', '.join(CUDAGRAPH_MODES)}) sets XLA's command buffers "
              "(CUDA graphs) of each step program on a GPU: NONE none, PIECEWISE the runs between attention "
              "kernels and loops, FULL whole programs where XLA can, FULL_DECODE_ONLY decode programs whole and "
              "mixed ones none, FULL_AND_PIECEWISE decode whole and mixed piecewise; no effect on CPU "
              "(default: XLA's own command buffers)", parse=parse_compilation_config, flags=("-O",))
    compilation_cache_dir: str | None = arg(
        None, "JAX persistent compilation cache ('' = off; default: <cache root>/xla, the cache root "
              "being $JAXLM_CACHE_DIR, else $XDG_CACHE_HOME/jaxlm, else ~/.cache/jaxlm)")

    # Set from compilation_config (vLLM's field name); not a flag of its own.
    cudagraph_mode: str | None = None

    def __post_init__(self) -> None:
        if self.compilation_config is not None:
            self.compilation_config = resolve_compilation_config(self.compilation_config)
            self.cudagraph_mode = self.compilation_config.get("cudagraph_mode", self.cudagraph_mode)
        if self.cudagraph_mode is not None:
            self.cudagraph_mode = check_cudagraph_mode(self.cudagraph_mode)

    def resolved_cache_dir(self) -> str | None:
        """The compilation cache directory, or None when off."""
        if self.compilation_cache_dir is not None:
            return self.compilation_cache_dir or None
        root = jaxlm_cache_root()
        return os.path.join(root, "xla") if root else None
