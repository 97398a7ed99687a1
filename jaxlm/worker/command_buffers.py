"""vLLM's cudagraph_mode as XLA's command buffers: the compiler options of each step program.

vLLM captures the model's forward in CUDA graphs (`CUDAGraphWrapper`); XLA records a program's
kernels into command buffers (CUDA graphs on NVIDIA) itself, per run of consecutive thunks of the
kinds `xla_gpu_enable_command_buffer` lists, each run at least `xla_gpu_graph_min_graph_size`
commands long. XLA's default list (jaxlib 0.10: FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN,
DYNAMIC_SLICE_FUSION; runs of 5) leaves out while loops and conditionals, so the XLA attention
loop over pages splits a step into pieces. The styles a mode assigns to programs:

  none       no command buffers: every kernel launched on its own;
  piecewise  XLA's kinds without CUSTOM_CALL: graphs between the attention kernels (the Pallas
             kernels are custom calls) and loops, as vLLM's piecewise graphs leave attention out;
  full       every kind XLA can record, loops and conditionals included, from a run of one: the
             whole program where XLA allows (a Triton custom call is recorded only where this
             XLA records it; gpu_check prints how many command buffers a program holds).

The options are compiler options of `.compile()`, so they are part of JAX's cache key; the
program cache's key holds the engine config, and with it the mode. Compiler options go through
PJRT's CompileOptions, which takes a repeated field as a full list (no +/- edits of XLA's
default, as XLA_FLAGS would take): each style is written out whole.
"""

from __future__ import annotations

from jaxlm.worker.step_programs import DECODE, MIXED, PROMPT_LOGPROBS

_XLA_KINDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUDNN", "DYNAMIC_SLICE_FUSION")
STYLES: dict[str, dict[str, str | int]] = {
    "none": {"xla_gpu_enable_command_buffer": ""},
    "piecewise": {"xla_gpu_enable_command_buffer": ",".join(_XLA_KINDS)},
    "full": {"xla_gpu_enable_command_buffer": ",".join(_XLA_KINDS + ("CUSTOM_CALL", "WHILE", "CONDITIONAL")),
             "xla_gpu_graph_min_graph_size": 1},
}
# mode -> (style of the programs a decode step runs, style of the others). A decode step runs a
# decode body (backends with kernels), or a mixed body of a bucket a decode step reaches (the XLA
# backend has no decode bodies), then a sampler.
_MODES = {
    "NONE": ("none", "none"),
    "PIECEWISE": ("piecewise", "piecewise"),
    "FULL": ("full", "full"),
    "FULL_DECODE_ONLY": ("full", "none"),
    "FULL_AND_PIECEWISE": ("full", "piecewise"),
}
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def program_style(mode: str | None, table: str, kind: str | None, T: int | None,
                  decode_reach: list[int] | None) -> str | None:
    """The style of one program (None: XLA's defaults). table "body" (kind MIXED, DECODE or
    PROMPT_LOGPROBS, token bucket T) or "sample". decode_reach: the mixed buckets decode steps
    run where the backend has no decode bodies (else None)."""
    if mode is None:
        return None
    decode, other = _MODES[mode]
    if table == "sample" or kind == DECODE:
        return decode
    if kind == MIXED and decode_reach is not None and T in decode_reach:
        return decode
    assert kind in (MIXED, PROMPT_LOGPROBS), kind
    return other


def compiler_options(mode: str | None, platform: str, table: str, kind: str | None = None, T: int | None = None,
                     decode_reach: list[int] | None = None) -> dict[str, str | int]:
    """The compiler options of one program on `platform` (jax's backend name): {} off a GPU,
    where command buffers do not exist, and without a mode."""
    if platform not in GPU_PLATFORMS:
        return {}
    style = program_style(mode, table, kind, T, decode_reach)
    return dict(STYLES[style]) if style is not None else {}
