"""Mixtral: Mistral's attention, every layer an MoE block; top-k softmax weights always
renormalised. The checkpoint names its block ``block_sparse_moe`` and its experts' matrices
``w1`` (gate), ``w3`` (up), ``w2`` (down); they are read as the shared MoE block's names."""

from __future__ import annotations

import re
from typing import Any

from jaxlm.models.llama_moe import LlamaMoEForCausalLM
from jaxlm.models.moe import MoEArgs

_EXPERT_W = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_W_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(LlamaMoEForCausalLM):
    @classmethod
    def moe_args(cls, config: Any) -> MoEArgs:
        return MoEArgs.from_hf_config(config, num_experts=config.num_local_experts,
                                      intermediate_size=config.intermediate_size, renormalize=True)

    def canonical_name(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _EXPERT_W.sub(lambda m: f".experts.{m.group(1)}.{_W_NAMES[m.group(2)]}.", name)
