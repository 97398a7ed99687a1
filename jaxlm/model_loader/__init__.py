"""Model loading: path → resolved ModelConfig, tokenizer, and a loaded flax.nnx model.

The package namespace is lazy (PEP 562): ``import jaxlm.model_loader.errors`` (what the models
and the front end need) runs no jax, flax or transformers import, and the models importing the
errors do not loop back through the loader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> submodule holding it
_EXPORTS: dict[str, str] = {
    "CorruptCheckpointError": "errors",
    "MissingWeightsError": "errors",
    "NoWeightsError": "errors",
    "UnexpectedWeightError": "errors",
    "UnsupportedDtypeError": "errors",
    "UnsupportedModelError": "errors",
    "WeightLoadError": "errors",
    "WeightShapeError": "errors",
    "BaseModelLoader": "loader",
    "DefaultModelLoader": "loader",
    "GGUFModelLoader": "loader",
    "OrbaxModelLoader": "loader",
    "get_model": "loader",
    "get_model_loader": "loader",
    "save_orbax": "orbax_utils",
    "get_jax_dtype": "resolve",
    "resolve_model_config": "resolve",
    "get_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the names __getattr__ serves, for type checkers (hence unused here)
    from jaxlm.model_loader.errors import (  # noqa: F401
        CorruptCheckpointError, MissingWeightsError, NoWeightsError, UnexpectedWeightError,
        UnsupportedDtypeError, UnsupportedModelError, WeightLoadError, WeightShapeError,
    )
    from jaxlm.model_loader.loader import (  # noqa: F401
        BaseModelLoader, DefaultModelLoader, GGUFModelLoader, OrbaxModelLoader, get_model, get_model_loader,
    )
    from jaxlm.model_loader.orbax_utils import save_orbax  # noqa: F401
    from jaxlm.model_loader.resolve import get_jax_dtype, resolve_model_config  # noqa: F401
    from jaxlm.model_loader.tokenizer import get_tokenizer  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
