"""Decoders as pooling models (vLLM's ``as_embedding_model`` / ``as_seq_cls_model``): the
family's own class, its LM head swapped for last-token pooling (embedders: Qwen3-Embedding,
e5-mistral) or a ``score`` head (reward and classifier models). Causal attention, no KV cache.

Checkpoints saved from ``Qwen3Model``/``LlamaModel`` have no ``model.`` prefix and a
``*ForCausalLM`` checkpoint served with ``--convert embed`` still carries ``lm_head.weight``:
both load here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.layers import Linear, ParallelStyle
from jaxlm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


class _DecoderEmbedding:
    """Mixed in before a CausalLMBase family: hidden states out, last-token pooling."""

    is_pooling_model = True
    has_lm_head = False
    causal = True
    default_pooling_type = "LAST"
    uses_token_types = False

    def canonical_name(self, name: str) -> str:
        name = super().canonical_name(name)
        return name if name.startswith(("model.", "score.", "lm_head.")) else "model." + name

    def _is_ignored(self, name: str) -> bool:
        return name == "lm_head.weight" or super()._is_ignored(name)

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def num_labels(self) -> int | None:
        return None

    def pooling_hidden(self, input_ids, positions, token_type_ids, md) -> jax.Array:
        hidden, _ = self.decoder()(input_ids, positions, [None] * self.args.num_layers, md)
        return hidden

    def pooling_head(self, pooled: jax.Array) -> jax.Array:
        return pooled


class _DecoderSeqCls(_DecoderEmbedding):
    """A ``score`` head [hidden -> num_labels] on the last token (HF's *ForSequenceClassification)."""

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        super().build(config, rngs)
        self._num_labels = int(getattr(config, "num_labels", 2))
        self.score = Linear(self.args.hidden_size, self._num_labels, bias=False, parallel=ParallelStyle.REPLICATED,
                            dtype=self.dtype, rngs=rngs)

    @property
    def num_labels(self) -> int:
        return self._num_labels

    def pooling_head(self, pooled):
        return self.score(pooled).astype(jnp.float32)


class LlamaModel(_DecoderEmbedding, LlamaForCausalLM):
    pass


class MistralModel(_DecoderEmbedding, MistralForCausalLM):
    pass


class Qwen2Model(_DecoderEmbedding, Qwen2ForCausalLM):
    pass


class Qwen3Model(_DecoderEmbedding, Qwen3ForCausalLM):
    pass


class LlamaForSequenceClassification(_DecoderSeqCls, LlamaForCausalLM):
    pass


class MistralForSequenceClassification(_DecoderSeqCls, MistralForCausalLM):
    pass


class Qwen2ForSequenceClassification(_DecoderSeqCls, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(_DecoderSeqCls, Qwen3ForCausalLM):
    pass
