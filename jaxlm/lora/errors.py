"""The error a bad adapter raises: a leaf module, so the front end maps it to HTTP 400 without
importing jax."""

from __future__ import annotations


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served (no adapter_config.json, rank above max_lora_rank, a target
    module the model lacks, another base model's shapes, an unsupported PEFT type): the message
    says which adapter and what is wrong. Nothing already loaded is touched."""

    def __init__(self, adapter: str, problem: str):
        super().__init__(f"LoRA adapter {adapter!r}: {problem}")
        self.adapter = adapter
        self.problem = problem

    def __reduce__(self):
        return type(self), (self.adapter, self.problem)
