"""Attention backends behind one call signature, chosen by name (``--attention-backend``)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Protocol

import jax

from jaxlm.attention.metadata import AttentionMetadata


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
    ) -> tuple[jax.Array, jax.Array]:
        """Write k/v of this step into kv_cache, attend; returns (out [T, Hq, D], kv_cache)."""
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

    def __call__(self, q, k, v, kv_cache, md, **kw):
        return self.fn(q, k, v, kv_cache, md, **kw)

    def constraints(self, block_size: int, head_dim: int) -> None:
        return None  # one function for every step: no kernel rules, no decode flavour


# name -> "module:attribute" of a zero-argument factory returning an AttentionBackend.
_BACKENDS = {
    "xla": "jaxlm.attention.backends:_make_xla",
    "pallas": "jaxlm.attention.pallas_backend:make_pallas_backend",
}


def _make_xla() -> AttentionBackend:
    from jaxlm.attention.xla_backend import paged_attention_xla

    return FunctionBackend("xla", paged_attention_xla)


def resolve_backend_name(name: str, platform: str | None = None) -> str:
    """``auto`` is pallas on GPU and xla elsewhere."""
    if name == "auto":
        platform = platform or jax.default_backend()
        return "pallas" if platform in ("gpu", "cuda", "rocm") else "xla"
    if name not in _BACKENDS:
        raise ValueError(
            f"Unknown attention backend {name!r}; choose one of: auto, {', '.join(_BACKENDS)}"
        )
    return name


def get_attention_backend(name: str = "auto", platform: str | None = None) -> AttentionBackend:
    module, attr = _BACKENDS[resolve_backend_name(name, platform)].split(":")
    return getattr(importlib.import_module(module), attr)()
