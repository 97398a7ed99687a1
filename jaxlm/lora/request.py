"""LoRARequest: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

A msgspec Struct, so it travels inside an EngineCoreRequest to engine-core processes as it is.
Two requests with the same ``lora_int_id`` share one adapter slot and one prefix-cache space.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True):
    """``LoRARequest(lora_name, lora_int_id, lora_path)``: ``lora_int_id`` (> 0) keys the adapter
    in the engine; ``lora_path`` is a PEFT directory or an ``org/name`` in the local HF cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or not 0 < self.lora_int_id < 2**63):
            raise ValueError(f"lora_int_id must be an integer in [1, 2**63), got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {type(self.lora_path).__name__}")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        # vLLM: adapters are equal by name (the server's registry keys them so).
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
