"""Which ``QuantizationConfig`` a model gets: ``--quantization`` or the checkpoint's
``quantization_config.quant_method`` (vLLM's rule: both given must agree)."""

from __future__ import annotations

from typing import Any

from jaxlm.models.quantization.base_config import QuantizationConfig


def quantization_methods() -> dict[str, type[QuantizationConfig]]:
    """Every supported format by its vLLM name (``QUANTIZATION_METHODS``, the CLI's choices)."""
    from jaxlm.models.quantization.awq import AWQConfig
    from jaxlm.models.quantization.compressed_tensors import CompressedTensorsConfig
    from jaxlm.models.quantization.fp8 import Fp8Config
    from jaxlm.models.quantization.gguf import GGUFConfig
    from jaxlm.models.quantization.gptq import GPTQConfig

    return {c.get_name(): c for c in (Fp8Config, AWQConfig, GPTQConfig, CompressedTensorsConfig, GGUFConfig)}


def _checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):  # transformers may hold it as a QuantizationConfigMixin
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    return dict(raw)


def _unsupported(name: str, where: str) -> ValueError:
    supported = ", ".join(sorted(quantization_methods())) or "none"
    return ValueError(f"{where} quantization method {name!r} is not supported by jaxlm; supported: {supported}")


def get_quantization_config(quantization: str | None, hf_config: Any) -> QuantizationConfig | None:
    """The model's config, or None for float weights (``none``: a GGUF file dequantized)."""
    methods = quantization_methods()
    checkpoint = _checkpoint_quant_config(hf_config)
    if quantization == "none":
        if checkpoint is not None and checkpoint.get("quant_method") != "gguf":
            raise ValueError(f"--quantization none dequantizes GGUF files only; this checkpoint is "
                             f"{checkpoint.get('quant_method')!r}: leave --quantization out")
        return None
    if checkpoint is not None:
        method = checkpoint.get("quant_method", "")
        name = str(getattr(method, "value", method)).lower().replace("_", "-")
        if not name:
            raise ValueError("the checkpoint's quantization_config has no quant_method")
        if quantization is not None and quantization != name:  # (resolve copies the checkpoint's in)
            raise ValueError(f"--quantization {quantization} does not match the checkpoint's quantization "
                             f"method {name!r}: leave --quantization out, or pass {name}")
        if name not in methods:
            raise _unsupported(name, "the checkpoint's")
        return methods[name].from_config(checkpoint)
    if quantization is None:
        return None
    if quantization not in methods:
        raise _unsupported(quantization, "--quantization")
    return methods[quantization].from_config({})
