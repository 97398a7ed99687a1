"""Flax nnx model families and the architecture registry."""

from jaxlm.models.registry import ModelRegistry, get_model_architecture
from jaxlm.models.utils import get_param_partition_spec

__all__ = ["ModelRegistry", "get_model_architecture", "get_param_partition_spec"]
