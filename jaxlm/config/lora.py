"""LoRAConfig: adapters served next to the base model (vLLM's LoRA flags)."""

from __future__ import annotations

import dataclasses

from jaxlm.config.utils import arg

# max_loras x max_lora_rank: the width of each layer's stacked slots (e.g. 64 slots of rank 256).
_MAX_SLOT_COLUMNS = 2**14


@dataclasses.dataclass
class LoRAConfig:
    """LoRA adapters served next to the base model."""

    enable_lora: bool = arg(False, "serve LoRA adapters (PEFT directories) next to the base model")
    max_loras: int = arg(1, "most distinct adapters in one step (device slots); requests for others wait")
    max_lora_rank: int = arg(16, "largest adapter rank accepted; every slot is padded to it")
    max_cpu_loras: int | None = arg(None, "adapters kept loaded in host memory, ready for a slot "
                                          "(default: --max-loras)")

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_loras * self.max_lora_rank > _MAX_SLOT_COLUMNS:
            raise ValueError(f"max_loras x max_lora_rank = {self.max_loras * self.max_lora_rank} is more than "
                             f"{_MAX_SLOT_COLUMNS}: every adaptable layer holds that many columns of A and rows of B")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int):
            raise ValueError(f"max_cpu_loras must be an integer, got {self.max_cpu_loras!r}")
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
