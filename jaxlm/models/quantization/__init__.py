"""Quantized weights (vLLM's ``model_executor/layers/quantization``): the seam and its formats.

See ``base_config.py`` for the seam; ``registry.py`` for how a model's format is chosen."""

from jaxlm.models.quantization.base_config import (
    FusedMoEMethodBase, LinearMethodBase, QuantizationConfig, QuantizeMethodBase)
from jaxlm.models.quantization.registry import get_quantization_config, quantization_methods
from jaxlm.models.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

__all__ = [
    "FusedMoEMethodBase", "LinearMethodBase", "QuantizationConfig", "QuantizeMethodBase",
    "UnquantizedFusedMoEMethod", "UnquantizedLinearMethod", "get_quantization_config", "quantization_methods",
]
