"""Admission of adapters in the front end: a request's adapter is checked against the model
before anything is queued, so a bad adapter fails its own request (HTTP 400) and nothing else.

The model's adaptable layers come from the abstract model (shapes only, no weights), built once
on first use; the engine cores check again when they read the matrices.
"""

from __future__ import annotations

import threading
from typing import Any

from jaxlm.config import LoRAConfig, ModelConfig
from jaxlm.lora.peft import AdapterSpec, check_adapter
from jaxlm.lora.request import LoRARequest
from jaxlm.lora.targets import LoRATargets, lora_targets


class LoRAChecker:
    def __init__(self, model_config: ModelConfig, lora_config: LoRAConfig) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self._targets: LoRATargets | None = None
        self._checked: dict[tuple[int, str], AdapterSpec] = {}
        self._lock = threading.Lock()  # the server checks on worker threads

    @property
    def targets(self) -> LoRATargets:
        with self._lock:
            if self._targets is None:
                from jaxlm.model_loader.loader import init_abstract_model

                model = init_abstract_model(self.model_config, attn_backend=None, mesh=None)
                self._targets = lora_targets(model)
            return self._targets

    def check(self, lora_request: Any) -> AdapterSpec | None:
        """The adapter's spec (None for the base model); ValueError (LoRAAdapterError for the
        adapter itself) naming what is wrong."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not self.lora_config.enable_lora:
            raise ValueError("LoRA adapters are not enabled: start the engine with enable_lora=True (--enable-lora)")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        spec = self._checked.get(key)
        if spec is None:
            spec = check_adapter(lora_request.lora_name, lora_request.lora_path, self.targets,
                                 self.lora_config.max_lora_rank)
            self._checked[key] = spec
        return spec

    def forget(self, lora_int_id: int) -> None:
        """Drop what was checked for an adapter (unloaded: its directory may change before a reload)."""
        for key in [k for k in self._checked if k[0] == lora_int_id]:
            del self._checked[key]
