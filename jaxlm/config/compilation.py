"""CompilationConfig: the AOT-compiled step programs and their on-disk cache."""

from __future__ import annotations

import dataclasses
import os

from jaxlm.config.utils import arg, jaxlm_cache_root, parse_int_list, parse_token_buckets


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
    compilation_cache_dir: str | None = arg(
        None, "JAX persistent compilation cache ('' = off; default: <cache root>/xla, the cache root "
              "being $JAXLM_CACHE_DIR, else $XDG_CACHE_HOME/jaxlm, else ~/.cache/jaxlm)")

    def resolved_cache_dir(self) -> str | None:
        """The compilation cache directory, or None when off."""
        if self.compilation_cache_dir is not None:
            return self.compilation_cache_dir or None
        root = jaxlm_cache_root()
        return os.path.join(root, "xla") if root else None
