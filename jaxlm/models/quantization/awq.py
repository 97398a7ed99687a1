"""AWQ checkpoints (AutoAWQ's GEMM layout, vLLM's ``awq`` method): 4-bit, group scales and zeros."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from jaxlm.models.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from jaxlm.models.quantization.fp8 import is_ignored
from jaxlm.models.quantization.int_weight import AWQLinearMethod
from jaxlm.models.quantization.int_weight_moe import PackedIntMoEMethod


@dataclasses.dataclass(frozen=True)
class AWQConfig(QuantizationConfig):
    weight_bits: int = 4
    group_size: int = 128
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        if not config:
            raise ValueError("--quantization awq needs an AWQ checkpoint (its config.json's quantization_config); "
                             "online quantization is fp8 only")
        bits = int(config.get("w_bit", config.get("bits", 4)))
        group = int(config.get("q_group_size", config.get("group_size", 128)))
        if bits != 4:
            raise ValueError(f"AWQ checkpoint: {bits}-bit weights are not supported (4-bit only)")
        if not config.get("zero_point", True):
            raise ValueError("AWQ checkpoint: zero_point=false is not supported")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint: version {version!r} is not supported (gemm only)")
        return cls(bits, group, tuple(config.get("modules_to_not_convert") or ()))

    def get_quant_method(self, layer: nnx.Module, prefix: str) -> QuantizeMethodBase | None:
        if is_ignored(prefix, self.modules_to_not_convert):
            return None
        linear = AWQLinearMethod(bits=self.weight_bits, group_size=self.group_size, has_zeros=True)
        # The stacked MoE experts: the same tensors per expert (vLLM's AWQMoEMethod / GPTQMarlinMoEMethod).
        return linear if hasattr(layer, "in_features") else PackedIntMoEMethod(linear)

    def describe(self) -> str:
        return f"awq ({self.weight_bits}-bit, group {self.group_size})"
