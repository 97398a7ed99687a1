"""Attention backends behind one call signature, chosen by name (``--attention-backend``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
from typing import Any, Callable, Protocol

import jax

from jaxlm.attention.kv_quant import KVQuant
from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.config.utils import jaxlm_cache_root
from kernels_cpu.build import KernelBuildError, load_cpu_kernels

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: jax.Array | None = None,
        v_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Write k/v of this step into kv_cache, attend; returns (out [T, Hq, D], kv_cache).
        An fp8 cache stores k / k_scale and v / v_scale (attention/kv_quant.py)."""
        ...

    def constraints(self, block_size: int, head_dim: int) -> Any:
        """Kernel shape rules for this cache geometry (``PallasConstraints``), or None when
        the backend has no kernels: then the runner compiles no decode-only programs."""
        ...


@dataclasses.dataclass(frozen=True)
class FunctionBackend:
    """A backend that is one function with the AttentionBackend signature."""

    name: str
    fn: Callable
    # fp8 cache settings the model's attention layers read (None: a float cache).
    kv_quant: KVQuant | None = None

    def __call__(self, q, k, v, kv_cache, md, **kw):
        return self.fn(q, k, v, kv_cache, md, **kw)

    def constraints(self, block_size: int, head_dim: int) -> None:
        return None  # one function for every step: no kernel rules, no decode flavour


# name -> "module:attribute" of a zero-argument factory returning an AttentionBackend.
_BACKENDS = {
    "xla": "jaxlm.attention.backends:_make_xla",
    "pallas": "jaxlm.attention.pallas_backend:make_pallas_backend",
    "cpu": "jaxlm.attention.backends:_make_cpu",
}


def _make_xla() -> AttentionBackend:
    from jaxlm.attention.xla_backend import paged_attention_xla

    return FunctionBackend("xla", paged_attention_xla)


def _make_cpu() -> AttentionBackend:
    from jaxlm.attention.xla_backend import paged_attention_xla

    load_cpu_kernels(kernel_build_dir())
    return FunctionBackend("cpu", functools.partial(paged_attention_xla, native_decode=True))


def kernel_build_dir() -> str | None:
    """Where the C++ kernels are built: beside the other caches (None: a temporary directory)."""
    root = jaxlm_cache_root()
    return os.path.join(root, "kernels") if root else None


@functools.lru_cache(maxsize=None)
def _kernel_unavailable(build_dir: str | None) -> str | None:
    """Why the C++ kernel cannot be used here (None: built and registered). Asked once per build
    directory: a start resolves ``auto`` for the worker and again for the program cache's key, and
    a failing compiler is not run (nor logged) twice."""
    try:
        load_cpu_kernels(build_dir)
        return None
    except KernelBuildError as e:
        logger.warning("Attention backend xla: the C++ decode kernel is not available (%s)", e)
        return str(e)


def cpu_kernels_unavailable() -> str | None:
    """Why the C++ kernels (kernels_cpu) cannot be used in this process; None: built and
    registered (the GGUF block matmul asks too)."""
    return _kernel_unavailable(kernel_build_dir())


def resolve_backend_name(name: str, platform: str | None = None) -> str:
    """``auto`` is pallas on GPU; on CPU it is cpu (xla with the C++ decode kernel) when the
    kernel builds here, else xla."""
    platform = platform or jax.default_backend()
    if name == "auto":
        if platform in ("gpu", "cuda", "rocm"):
            return "pallas"
        if platform != "cpu":
            return "xla"
        return "xla" if _kernel_unavailable(kernel_build_dir()) else "cpu"
    if name not in _BACKENDS:
        raise ValueError(
            f"Unknown attention backend {name!r}; choose one of: auto, {', '.join(_BACKENDS)}"
        )
    if name == "cpu" and platform != "cpu":
        raise ValueError(f"Attention backend 'cpu' runs on CPU only, not on {platform!r}")
    return name


def get_attention_backend(name: str = "auto", platform: str | None = None,
                          kv_quant: KVQuant | None = None) -> AttentionBackend:
    """The backend ``name`` resolves to; ``kv_quant``: it keeps an fp8 cache (refused where its
    kernels cannot read one)."""
    module, attr = _BACKENDS[resolve_backend_name(name, platform)].split(":")
    backend = getattr(importlib.import_module(module), attr)()
    if kv_quant is None:
        return backend
    why = backend.fp8_unsupported() if hasattr(backend, "fp8_unsupported") else None
    if why:
        raise ValueError(f"kv_cache_dtype fp8: the {backend.name} attention backend cannot read an fp8 KV cache "
                         f"here ({why}); use --kv-cache-dtype auto or another --attention-backend")
    return dataclasses.replace(backend, kv_quant=kv_quant)
