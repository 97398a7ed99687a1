"""GPTQ checkpoints (AutoGPTQ / GPTQModel's v1 format, vLLM's ``gptq`` method): 4- or 8-bit
weights packed along the input, group scales and zeros, ``desc_act`` off."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from jaxlm.models.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from jaxlm.models.quantization.fp8 import is_ignored
from jaxlm.models.quantization.int_weight import GPTQLinearMethod
from jaxlm.models.quantization.int_weight_moe import PackedIntMoEMethod


@dataclasses.dataclass(frozen=True)
class GPTQConfig(QuantizationConfig):
    weight_bits: int = 4
    group_size: int = 128
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        if not config:
            raise ValueError("--quantization gptq needs a GPTQ checkpoint (its config.json's quantization_config); "
                             "online quantization is fp8 only")
        bits, group = int(config.get("bits", 4)), int(config.get("group_size", 128))
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoint: {bits}-bit weights are not supported (4 or 8)")
        if config.get("desc_act"):
            raise ValueError("GPTQ checkpoint: desc_act=true (act-order: input rows permuted by g_idx) is not "
                             "supported; quantize with desc_act=false")
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt != "gptq":
            raise ValueError(f"GPTQ checkpoint: checkpoint_format {fmt!r} is not supported (gptq, the v1 format)")
        if group != -1 and group <= 0:
            raise ValueError(f"GPTQ checkpoint: bad group_size {group}")
        return cls(bits, group, tuple(config.get("modules_to_not_convert") or ()))

    def get_quant_method(self, layer: nnx.Module, prefix: str) -> QuantizeMethodBase | None:
        if is_ignored(prefix, self.modules_to_not_convert):
            return None
        linear = GPTQLinearMethod(bits=self.weight_bits, group_size=self.group_size, has_zeros=True)
        # The stacked MoE experts: the same tensors per expert (vLLM's AWQMoEMethod / GPTQMarlinMoEMethod).
        return linear if hasattr(layer, "in_features") else PackedIntMoEMethod(linear)

    def describe(self) -> str:
        return f"gptq ({self.weight_bits}-bit, group {self.group_size})"
