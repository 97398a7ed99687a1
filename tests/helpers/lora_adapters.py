"""Tiny PEFT LoRA adapters for tests, and the transformers + peft reference outputs.

peft starts B at zero (an adapter that changes nothing would test nothing), so every A and B is
overwritten with random values large enough to move the greedy tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tests.helpers.tiny_models import load_hf_model

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base: str, out: str, *, seed: int, scale: float = 0.3, **lora_kwargs: Any) -> str:
    """A PEFT directory (adapter_config.json + adapter_model.safetensors) for the model at
    ``base``: peft.LoraConfig(**lora_kwargs) with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_hf_model(base), LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def edit_adapter_config(path: str, **changes: Any) -> None:
    """Rewrite fields of an adapter's config (None deletes one)."""
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(file, "w") as f:
        json.dump(cfg, f)


class PeftReference:
    """Greedy continuations with their logprobs from transformers (+ peft), full recompute per token."""

    def __init__(self, base: str):
        self.base = base
        self._models: dict[str | None, Any] = {}

    def model(self, adapter: str | None):
        if adapter not in self._models:
            from peft import PeftModel

            m = load_hf_model(self.base)
            self._models[adapter] = (PeftModel.from_pretrained(m, adapter) if adapter else m).eval()
        return self._models[adapter]

    def prompt_logprobs(self, adapter: str | None, prompt: list[int]) -> list[float]:
        """The logprob of each prompt token after the first, given the ones before it."""
        with torch.no_grad():
            lp = torch.log_softmax(self.model(adapter)(torch.tensor([prompt])).logits[0].double(), -1)
        return [float(lp[i - 1, t]) for i, t in enumerate(prompt) if i > 0]

    def greedy(self, adapter: str | None, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        model, ids, tokens, logprobs = self.model(adapter), list(prompt), [], []
        with torch.no_grad():
            for _ in range(n):
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
                t = int(lp.argmax())
                tokens.append(t)
                logprobs.append(float(lp[t]))
                ids.append(t)
        return tokens, logprobs
