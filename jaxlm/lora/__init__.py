"""LoRA adapters: many fine-tunes of one base model served by one engine, mixed in one batch.

Light on purpose: ``from jaxlm.lora import LoRARequest`` imports neither jax nor flax. The
modules that do (``layers``: the slots inside ``Linear``; ``slots``: the runner's slot manager;
``targets``: a model's adaptable layers) are imported where they are used.
"""

from jaxlm.lora.errors import LoRAAdapterError
from jaxlm.lora.request import LoRARequest

__all__ = ["LoRAAdapterError", "LoRARequest"]
