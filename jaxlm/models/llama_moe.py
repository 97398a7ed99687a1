"""MoE families built on the Llama layers: the same attention and decoder layer, with the MoE
block (``models/moe.py``) in place of the MLP on the sparse layers and the dense MLP on the rest.

A family (``mixtral.py``, ``qwen_moe.py``, ``olmoe.py``) supplies its ``moe_args`` (expert
count and size, renormalisation, shared expert) and, where it differs, its attention.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from flax import nnx

from jaxlm.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from jaxlm.models.moe import FusedMoE, MoEArgs
from jaxlm.models.utils import MODEL_AXIS, stage_mesh


@dataclasses.dataclass(frozen=True)
class LlamaMoEArgs(LlamaArgs):
    moe: MoEArgs | None = None


def moe_decoder_layer(args: LlamaMoEArgs, layer_idx: int, rope, *, dtype, attn_backend, rngs: nnx.Rngs,
                      mesh: Any, expert_parallel: bool,
                      attention_cls: Callable[..., nnx.Module] | None = None) -> LlamaDecoderLayer:
    """A Llama decoder layer whose MLP is the MoE block when the layer is sparse."""
    moe = args.moe
    mlp = None
    if moe.sparse_layers[layer_idx]:
        shared = None
        if moe.shared_expert_intermediate_size:
            shared_args = dataclasses.replace(args, intermediate_size=moe.shared_expert_intermediate_size)
            shared = LlamaMLP(shared_args, dtype=dtype, rngs=rngs)
        mlp = FusedMoE(args.hidden_size, moe, args.hidden_act, dtype=dtype, rngs=rngs, mesh=mesh,
                       expert_parallel=expert_parallel, shared_expert=shared)
    attn = None
    if attention_cls is not None:
        attn = attention_cls(args, layer_idx, rope, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
    return LlamaDecoderLayer(args, layer_idx, rope, dtype=dtype, attn_backend=attn_backend, rngs=rngs,
                             self_attn=attn, mlp=mlp)


class LlamaMoEForCausalLM(LlamaForCausalLM):
    """Base of the Llama-like MoE families."""

    @classmethod
    def moe_args(cls, config: Any) -> MoEArgs:
        raise NotImplementedError

    @classmethod
    def make_args(cls, config: Any) -> LlamaMoEArgs:
        base = super().make_args(config)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return LlamaMoEArgs(**fields, moe=cls.moe_args(config))

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        tp = self.mesh.shape.get(MODEL_AXIS, 1) if self.mesh is not None else 1
        self.args.moe.check_parallel(tp, self.enable_expert_parallel)
        super().build(config, rngs)

    def attention_cls(self) -> Callable[..., nnx.Module] | None:
        """The family's own attention module (None: Llama's)."""
        return None

    def _moe_mesh(self) -> Any:
        """What the MoE block's shard_map runs over: like attention, the stage sub-mesh's
        abstract shape under pipeline parallel (one for every stage)."""
        if self.mesh is None or self.mesh.shape.get(MODEL_AXIS, 1) == 1:
            return None
        return stage_mesh(self.mesh, 0).abstract_mesh if self.pipeline_size > 1 else self.mesh

    @property
    def decoder_layer_cls(self) -> Callable[..., nnx.Module]:
        """The Llama layer with the MoE block on the sparse layers (a factory, not a class)."""
        return functools.partial(moe_decoder_layer, mesh=self._moe_mesh(),
                                 expert_parallel=self.enable_expert_parallel, attention_cls=self.attention_cls())
