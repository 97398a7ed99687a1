"""compressed-tensors checkpoints (llm-compressor's; vLLM's ``compressed-tensors`` method).

Supported schemes, one config group targeting ``Linear`` (an MoE layer's per-expert Linears
included: ``Fp8MoEMethod`` / ``PackedIntMoEMethod`` hold them stacked):
- ``pack-quantized`` symmetric int weights, 4 or 8 bits, group or channel scales, no activation
  quantization (W4A16 / W8A16) -> ``CompressedTensorsWNA16Method``;
- ``float-quantized`` fp8 e4m3 weights, tensor or channel scales (FP8 / FP8-dynamic: the
  activations are quantized per tensor at run time on the fp8 dot) -> ``Fp8LinearMethod``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from jaxlm.models.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from jaxlm.models.quantization.fp8 import Fp8LinearMethod, is_ignored
from jaxlm.models.quantization.fp8_moe import Fp8MoEMethod
from jaxlm.models.quantization.int_weight import CompressedTensorsWNA16Method
from jaxlm.models.quantization.int_weight_moe import PackedIntMoEMethod


def _err(what: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint: {what} is not supported (jaxlm reads pack-quantized "
                      "symmetric W4A16/W8A16 and float-quantized FP8 weights)")


@dataclasses.dataclass(frozen=True)
class CompressedTensorsConfig(QuantizationConfig):
    format: str = "pack-quantized"
    num_bits: int = 4
    group_size: int = -1  # -1: channel
    per_channel: bool = True  # fp8: channel (else tensor) scales
    static_input_scale: bool = False
    ignore: tuple[str, ...] = ()

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        if not config:
            raise ValueError("--quantization compressed-tensors needs a compressed-tensors checkpoint; "
                             "online quantization is fp8 only")
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise _err(f"{len(groups)} config groups")
        group = next(iter(groups.values()))
        if [str(t) for t in group.get("targets", ["Linear"])] != ["Linear"]:
            raise _err(f"targets {group.get('targets')}")
        fmt = str(group.get("format") or config.get("format") or "")
        weights = group.get("weights") or {}
        acts = group.get("input_activations")
        strategy = str(weights.get("strategy"))
        if not weights.get("symmetric", True):
            raise _err("asymmetric weights (zero points)")
        ignore = tuple(config.get("ignore") or ())
        if fmt == "pack-quantized":
            bits = int(weights.get("num_bits", 4))
            if weights.get("type", "int") != "int" or bits not in (4, 8):
                raise _err(f"pack-quantized {weights.get('type')} {bits}-bit weights")
            if acts:
                raise _err("activation quantization with integer weights (W8A8 int8)")
            if strategy == "group":
                group_size = int(weights.get("group_size") or 0)
                if group_size <= 0:
                    raise _err(f"group_size {weights.get('group_size')}")
            elif strategy == "channel":
                group_size = -1
            else:
                raise _err(f"weight strategy {strategy!r}")
            if weights.get("actorder"):
                raise _err(f"actorder={weights.get('actorder')!r}")
            return cls(fmt, bits, group_size, ignore=ignore)
        if fmt == "float-quantized":
            if weights.get("type") != "float" or int(weights.get("num_bits", 8)) != 8:
                raise _err(f"float-quantized {weights.get('type')} {weights.get('num_bits')}-bit weights")
            if strategy not in ("tensor", "channel"):
                raise _err(f"fp8 weight strategy {strategy!r}")
            static = bool(acts) and not acts.get("dynamic", True)
            if static and acts.get("strategy") != "tensor":
                raise _err(f"static fp8 activations by {acts.get('strategy')!r}")
            return cls(fmt, 8, per_channel=strategy == "channel", static_input_scale=static, ignore=ignore)
        raise _err(f"format {fmt!r}")

    def get_quant_method(self, layer: nnx.Module, prefix: str) -> QuantizeMethodBase | None:
        if is_ignored(prefix, self.ignore):
            return None
        experts = not hasattr(layer, "in_features")  # the stacked MoE experts
        if self.format == "float-quantized":
            cls = Fp8MoEMethod if experts else Fp8LinearMethod
            return cls(serialized=True, per_channel=self.per_channel, static_input_scale=self.static_input_scale)
        linear = CompressedTensorsWNA16Method(bits=self.num_bits, group_size=self.group_size, has_zeros=False)
        return PackedIntMoEMethod(linear) if experts else linear

    def describe(self) -> str:
        if self.format == "float-quantized":
            return f"compressed-tensors (fp8, per-{'channel' if self.per_channel else 'tensor'})"
        group = "channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"compressed-tensors (w{self.num_bits}a16, {group})"
