"""The layers of a model an adapter may change: every ``Linear`` of its decoder layers.

Module trees mirror HF names, so a PEFT module name (``model.layers.0.self_attn.q_proj``) is the
nnx path of our ``Linear``. A family that fuses several of HF's linears into one checkpoint
tensor, or several of ours into one HF module, says so with vLLM's ``packed_modules_mapping``
(``{"c_attn": ("q_proj", "k_proj", "v_proj")}``): an adapter on the fused module is split over
the parts' output columns. Sizes are the checkpoint's (HF) ones, whatever the tensor-parallel
layout, so one description checks an adapter in the front end and in every engine core.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LoRATarget:
    """One adaptable ``Linear``: its path (= HF module name) and HF in/out features."""

    path: str
    in_features: int
    out_features: int


@dataclasses.dataclass(frozen=True)
class LoRATargets:
    """Every adaptable ``Linear`` of a model, by path, and its fused-module names."""

    architecture: str
    modules: dict[str, LoRATarget]
    packed: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def short_names(self) -> set[str]:
        """What ``target_modules`` may name: the linears' own names and the fused names."""
        return {p.rsplit(".", 1)[-1] for p in self.modules} | set(self.packed)

    def resolve(self, module: str) -> list[tuple[LoRATarget, int, int]] | None:
        """A PEFT module path -> [(target, first output column, last + 1)] in the adapter's B
        (one part unless the module is fused); None when the model has no such layer."""
        if module in self.modules:
            t = self.modules[module]
            return [(t, 0, t.out_features)]
        parent, _, name = module.rpartition(".")
        parts = self.packed.get(name)
        if parts is None:
            return None
        out, start = [], 0
        for part in parts:
            t = self.modules.get(f"{parent}.{part}" if parent else part)
            if t is None:
                return None
            out.append((t, start, start + t.out_features))
            start += t.out_features
        return out


def lora_targets(model: Any) -> LoRATargets:
    """The adaptable layers of a built (or abstract) model: the ``Linear``s of its decoder layers."""
    from flax import nnx

    from jaxlm.models.layers import Linear

    layers = model.decoder().decoder_layers()
    in_layers = {id(node) for layer in layers for _, node in nnx.iter_graph(layer)}
    modules = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and id(node) in in_layers:
            name = ".".join(str(p) for p in path)
            modules[name] = LoRATarget(name, *linear_hf_features(node))
    packed = {k: tuple(v) for k, v in getattr(type(model), "packed_modules_mapping", {}).items()}
    return LoRATargets(type(model).__name__, modules, packed)


def linear_hf_features(linear: Any) -> tuple[int, int]:
    """(in, out) of a Linear as the checkpoint stores it (KV heads repeated for tensor parallel
    count once)."""
    in_features, out_features = linear.in_features, linear.out_features
    repeat = linear.kv_repeat
    if repeat is not None:
        out_features //= repeat[0]
    return int(in_features), int(out_features)
