"""Model loading: path → resolved ModelConfig, tokenizer, and a loaded flax.nnx model."""

from jaxlm.model_loader.errors import (
    CorruptCheckpointError,
    MissingWeightsError,
    NoWeightsError,
    UnexpectedWeightError,
    UnsupportedDtypeError,
    UnsupportedModelError,
    WeightLoadError,
    WeightShapeError,
)
from jaxlm.model_loader.loader import (
    BaseModelLoader,
    DefaultModelLoader,
    GGUFModelLoader,
    OrbaxModelLoader,
    get_model,
    get_model_loader,
)
from jaxlm.model_loader.orbax_utils import save_orbax
from jaxlm.model_loader.resolve import get_jax_dtype, resolve_model_config
from jaxlm.model_loader.tokenizer import get_tokenizer

__all__ = [
    "BaseModelLoader", "CorruptCheckpointError", "DefaultModelLoader", "GGUFModelLoader",
    "MissingWeightsError", "NoWeightsError", "OrbaxModelLoader", "UnexpectedWeightError",
    "UnsupportedDtypeError", "UnsupportedModelError", "WeightLoadError", "WeightShapeError",
    "get_jax_dtype", "get_model", "get_model_loader", "get_tokenizer", "resolve_model_config",
    "save_orbax",
]
