"""The models the server answers to: the base model's names and the LoRA adapters (vLLM's
``OpenAIServingModels``).

A request whose ``model`` is an adapter's name runs with that adapter; ``/v1/models`` lists each
adapter with ``parent`` set to its base model. Adapters come from ``--lora-modules`` (checked at
start-up: a bad one stops the server) and, when runtime updating is allowed, from
``POST /v1/load_lora_adapter`` (a bad one is a 400 naming the problem and nothing registered
changes). Each load gets a new ``lora_int_id``, so a name unloaded and loaded again never meets
the old adapter's slot or prefix-cache blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

from jaxlm.lora.module_path import LoRAModulePath
from jaxlm.lora.request import LoRARequest
from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol import ModelCard

# vLLM's switch for the load/unload routes, and jaxlm's spelling of it.
RUNTIME_LORA_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating_allowed() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true") for k in RUNTIME_LORA_ENV)


class ServingModels:
    def __init__(self, engine: Any, base_model_names: list[str], model_path: str | None, max_model_len: int,
                 lora_modules: list[LoRAModulePath] | None = None) -> None:
        self.engine = engine
        self.base_model_names = base_model_names
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        for module in lora_modules or []:
            self._register(module.name, module.path, module.base_model_name)  # raises: start-up fails

    def is_base_model(self, name: str) -> bool:
        return name in self.base_model_names

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.lora_requests.get(model) if model else None

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model or adapter this server does not serve."""
        if not model:
            return self.base_model_names[0]
        if model not in self.base_model_names and model not in self.lora_requests:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
        return model

    def model_cards(self) -> list[ModelCard]:
        cards = [ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
                 for name in self.base_model_names]
        cards += [ModelCard(id=lr.lora_name, root=lr.lora_path, max_model_len=self.max_model_len,
                            parent=lr.base_model_name or self.base_model_names[0])
                  for lr in self.lora_requests.values()]
        return cards

    # ---- run-time loading (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) -------------

    async def load_lora_adapter(self, name: Any, path: Any) -> LoRARequest:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided as non-empty strings.", 400,
                              "lora_name" if not isinstance(name, str) or not name else "lora_path")
        async with self._lock:
            return await asyncio.to_thread(self._register, name, path, None)

    async def unload_lora_adapter(self, name: Any) -> None:
        if not isinstance(name, str) or not name:
            raise OpenAIError("'lora_name' must be provided as a non-empty string.", 400, "lora_name")
        async with self._lock:
            lora = self.lora_requests.pop(name, None)
            if lora is None:
                raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name")
            self.engine.forget_lora(lora.lora_int_id)

    def _register(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        """Check the adapter against the model and add it; ValueError (400) naming the problem."""
        if name in self.lora_requests or name in self.base_model_names:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", 400, "lora_name")
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        try:
            self.engine.check_lora(lora)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "lora_path") from e
        self.lora_requests[name] = lora
        return lora
