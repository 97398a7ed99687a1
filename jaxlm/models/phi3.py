"""Phi-3 / Phi-4-mini: Llama with fused checkpoint tensors; partial rotary and longrope.

The checkpoint stores each layer's q/k/v as one ``self_attn.qkv_proj`` and its gate/up as one
``mlp.gate_up_proj``. They are split at load onto the separate q/k/v and gate/up Params, and
each part then takes its own sharding: under tensor parallel a device gets its query heads
and the KV heads they read, and its share of gate and of up (splitting the fused tensor evenly
would give device 0 all of q and device 1 all of k/v). KV heads repeated for tensor parallel
are repeated per part. ``partial_rotary_factor`` and ``longrope`` are rope variants read from
the config (models/rotary.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from flax import nnx

from jaxlm.models.base import WeightTarget
from jaxlm.models.llama import LlamaForCausalLM
from jaxlm.models.utils import hf_shape, to_param_layout

# fused checkpoint tensor -> the Params it holds, in its row order (under model.layers.N.)
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _rows(param: nnx.Variable, lo: int, hi: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda a: to_param_layout(param, a[lo:hi])


class Phi3ForCausalLM(LlamaForCausalLM):
    # HF's fused linears and the ones they hold here, in _FUSED's order (vLLM's name): a LoRA
    # adapter on qkv_proj / gate_up_proj is split over the parts' output rows the same way.
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def _fused_names(self) -> dict[str, tuple[str, ...]]:
        return {f"model.layers.{i}.{fused}": tuple(f"model.layers.{i}.{p}" for p in parts)
                for i in range(self.args.num_layers) for fused, parts in _FUSED.items()}

    def _skip_by_path(self, name: str) -> bool:
        return name.endswith(tuple(p for parts in _FUSED.values() for p in parts))

    def _extra_targets(self) -> dict[str, WeightTarget]:
        params = {".".join(map(str, path)): node for path, node in nnx.iter_graph(self)
                  if isinstance(node, nnx.Param)}
        targets = {}
        for fused, parts in self._fused_names().items():
            pieces, rows = [], 0
            for name in parts:
                param = params[name]
                n, cols = hf_shape(param)  # this part's rows in the checkpoint
                pieces.append((param, _rows(param, rows, rows + n)))
                rows += n
            targets[fused] = WeightTarget((rows, cols), pieces)
        return targets
