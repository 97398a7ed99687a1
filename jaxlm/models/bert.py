"""BERT and XLM-RoBERTa encoders (all-MiniLM, bge, multilingual-e5, bge-m3) and their
cross-encoder heads, for the pooling runner.

The same layer library as the decoders (``Linear``, ``LayerNorm``, ``Embedding``) and the same
attention call; what makes them encoders is the attention metadata's mask (bidirectional, no KV
cache: ``attention/dense.py``). BERT's own parts: absolute and token-type embeddings with a
LayerNorm, post-LN residual blocks, and for the cross-encoders the CLS -> dense -> tanh ->
linear head (BERT's ``pooler`` + ``classifier``, RoBERTa's ``classifier.dense`` /
``classifier.out_proj``). XLM-RoBERTa differs only by its position offset (``pad_token_id +
1``) and checkpoint prefix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.core.kv_cache_utils import KVCacheSpec
from jaxlm.models.base import CausalLMBase, DecoderStack, run_decoder_layers
from jaxlm.models.layers import Embedding, LayerNorm, Linear, ParallelStyle, get_act_fn

COLUMN, ROW, REPLICATED = ParallelStyle.COLUMN, ParallelStyle.ROW, ParallelStyle.REPLICATED


@dataclasses.dataclass(frozen=True)
class BertArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int  # XLM-RoBERTa: positions start after the padding index
    num_labels: int
    tie_word_embeddings: bool = True  # no LM head: the base builds none

    @classmethod
    def from_hf_config(cls, c: Any, position_offset: int) -> "BertArgs":
        if getattr(c, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ValueError(f"position_embedding_type={c.position_embedding_type!r} is not supported "
                             "(absolute positions only)")
        return cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                   max_positions=c.max_position_embeddings, type_vocab_size=max(1, int(c.type_vocab_size)),
                   layer_norm_eps=float(c.layer_norm_eps), hidden_act=c.hidden_act,
                   position_offset=position_offset, num_labels=int(getattr(c, "num_labels", 2)))


def _ln(args: BertArgs, dtype, rngs) -> LayerNorm:
    return LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype, rngs=rngs)


class BertEmbeddings(nnx.Module):
    def __init__(self, args: BertArgs, *, dtype, rngs: nnx.Rngs):
        h = args.hidden_size
        self.word_embeddings = Embedding(args.vocab_size, h, dtype=dtype, rngs=rngs)
        self.position_embeddings = Embedding(args.max_positions, h, dtype=dtype, rngs=rngs, shard_vocab=False)
        self.token_type_embeddings = Embedding(args.type_vocab_size, h, dtype=dtype, rngs=rngs, shard_vocab=False)
        self.LayerNorm = _ln(args, dtype, rngs)
        self.position_offset = args.position_offset

    def __call__(self, input_ids, positions, token_type_ids):
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nnx.Module):
    def __init__(self, args: BertArgs, *, dtype, attn_backend, rngs: nnx.Rngs):
        h = args.hidden_size
        self.num_heads, self.head_dim = args.num_heads, h // args.num_heads
        self.attn_backend = attn_backend
        self.query = Linear(h, h, bias=True, parallel=COLUMN, dtype=dtype, rngs=rngs)
        self.key = Linear(h, h, bias=True, parallel=COLUMN, dtype=dtype, rngs=rngs)
        self.value = Linear(h, h, bias=True, parallel=COLUMN, dtype=dtype, rngs=rngs)

    def __call__(self, x, kv_cache, md):
        T = x.shape[0]
        shape = (T, self.num_heads, self.head_dim)
        q, k, v = self.query(x).reshape(shape), self.key(x).reshape(shape), self.value(x).reshape(shape)
        out, kv_cache = self.attn_backend(q, k, v, kv_cache, md, scale=self.head_dim**-0.5)
        return out.reshape(T, -1), kv_cache


class BertDenseLN(nnx.Module):
    """dense -> + residual -> LayerNorm (BERT's SelfOutput and Output)."""

    def __init__(self, args: BertArgs, d_in: int, *, dtype, rngs: nnx.Rngs):
        self.dense = Linear(d_in, args.hidden_size, bias=True, parallel=ROW, dtype=dtype, rngs=rngs)
        self.LayerNorm = _ln(args, dtype, rngs)

    def __call__(self, h, residual):
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nnx.Module):
    def __init__(self, args: BertArgs, *, dtype, attn_backend, rngs: nnx.Rngs):
        setattr(self, "self", BertSelfAttention(args, dtype=dtype, attn_backend=attn_backend, rngs=rngs))
        self.output = BertDenseLN(args, args.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, kv_cache, md):
        h, kv_cache = getattr(self, "self")(x, kv_cache, md)
        return self.output(h, x), kv_cache


class BertIntermediate(nnx.Module):
    def __init__(self, args: BertArgs, *, dtype, rngs: nnx.Rngs):
        self.dense = Linear(args.hidden_size, args.intermediate_size, bias=True, parallel=COLUMN, dtype=dtype,
                            rngs=rngs)
        self.act = args.hidden_act
        get_act_fn(self.act)

    def __call__(self, x):
        return get_act_fn(self.act)(self.dense(x))


class BertLayer(nnx.Module):
    def __init__(self, args: BertArgs, *, dtype, attn_backend, rngs: nnx.Rngs):
        self.attention = BertAttention(args, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
        self.intermediate = BertIntermediate(args, dtype=dtype, rngs=rngs)
        self.output = BertDenseLN(args, args.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, md):
        x, kv_cache = self.attention(x, kv_cache, md)
        return self.output(self.intermediate(x), x), kv_cache


class BertEncoder(nnx.Module):
    def __init__(self, args: BertArgs, *, dtype, attn_backend, rngs: nnx.Rngs):
        self.layer = nnx.List([BertLayer(args, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
                               for _ in range(args.num_layers)])


class BertPooler(nnx.Module):
    """CLS -> dense -> tanh (BERT's pooler; RoBERTa's classifier.dense)."""

    def __init__(self, args: BertArgs, *, dtype, rngs: nnx.Rngs):
        self.dense = Linear(args.hidden_size, args.hidden_size, bias=True, parallel=REPLICATED, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.dense(x))


class BertStack(DecoderStack):
    def __init__(self, args: BertArgs, *, dtype, attn_backend, rngs: nnx.Rngs, pooler: bool):
        self.embeddings = BertEmbeddings(args, dtype=dtype, rngs=rngs)
        self.encoder = BertEncoder(args, dtype=dtype, attn_backend=attn_backend, rngs=rngs)
        self.pooler = BertPooler(args, dtype=dtype, rngs=rngs) if pooler else None

    def embed(self, input_ids, positions, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        return self.embeddings(input_ids, positions, token_type_ids)

    def decoder_layers(self):
        return self.encoder.layer

    def final(self, x):
        return x


class RobertaClassificationHead(nnx.Module):
    def __init__(self, args: BertArgs, *, dtype, rngs: nnx.Rngs):
        self.dense = Linear(args.hidden_size, args.hidden_size, bias=True, parallel=REPLICATED, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(args.hidden_size, args.num_labels, bias=True, parallel=REPLICATED, dtype=dtype,
                               rngs=rngs)

    def __call__(self, cls_hidden):
        return self.out_proj(jnp.tanh(self.dense(cls_hidden)))


class BertModel(CausalLMBase):
    """An encoder whose hidden states are pooled (embeddings); also the base of the heads."""

    is_pooling_model = True
    has_lm_head = False
    causal = False
    default_pooling_type = "CLS"
    _prefix = "bert"
    _position_offset_from_pad = False
    _with_pooler = False
    # Buffers and the unused pooler of an embedding checkpoint.
    _ignored_suffixes = ("position_ids", "rotary_emb.inv_freq")

    @classmethod
    def max_prompt_len(cls, config: Any) -> int:
        """Positions the embedding table holds for prompts (XLM-R's start after its padding index)."""
        args = cls.make_args(config)
        return args.max_positions - args.position_offset

    @classmethod
    def make_args(cls, config: Any) -> BertArgs:
        offset = int(config.pad_token_id) + 1 if cls._position_offset_from_pad else 0
        return BertArgs.from_hf_config(config, offset)

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        setattr(self, self._prefix, BertStack(self.args, dtype=self.dtype, attn_backend=self.attn_backend,
                                              rngs=rngs, pooler=self._with_pooler))

    def canonical_name(self, name: str) -> str:
        return name if name.startswith((self._prefix + ".", "classifier.")) else f"{self._prefix}.{name}"

    def _is_ignored(self, name: str) -> bool:
        if not self._with_pooler and name.startswith(f"{self._prefix}.pooler."):
            return True
        return super()._is_ignored(name)

    def decoder(self) -> BertStack:
        return getattr(self, self._prefix)

    def input_embedding(self) -> nnx.Module:
        return self.decoder().embeddings.word_embeddings

    @classmethod
    def kv_cache_spec(cls, args: BertArgs) -> KVCacheSpec:
        return KVCacheSpec(num_layers=args.num_layers, num_kv_heads=args.num_heads,
                           head_dim=args.hidden_size // args.num_heads)

    # ----- the pooling runner's interface --------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def num_labels(self) -> int | None:
        return None  # no classification head

    @property
    def uses_token_types(self) -> bool:
        """BERT's pairs mark their second text with token type 1; XLM-R has one type."""
        return self.args.type_vocab_size > 1

    def pooling_hidden(self, input_ids, positions, token_type_ids, md) -> jax.Array:
        stack = self.decoder()
        x = stack.embed(input_ids, positions, token_type_ids)
        x, _ = run_decoder_layers(stack.decoder_layers(), x, positions, [None] * self.args.num_layers, md)
        return stack.final(x)

    def pooling_head(self, pooled: jax.Array) -> jax.Array:
        return pooled


class XLMRobertaModel(BertModel):
    _prefix = "roberta"
    _position_offset_from_pad = True


class BertForSequenceClassification(BertModel):
    """Cross-encoder: CLS -> pooler (dense, tanh) -> classifier."""

    _with_pooler = True

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        super().build(config, rngs)
        self.classifier = Linear(self.args.hidden_size, self.args.num_labels, bias=True, parallel=REPLICATED,
                                 dtype=self.dtype, rngs=rngs)

    @property
    def num_labels(self) -> int:
        return self.args.num_labels

    def pooling_head(self, pooled):
        return self.classifier(self.decoder().pooler(pooled)).astype(jnp.float32)


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """Cross-encoder (bge-reranker): CLS -> classifier.dense, tanh -> classifier.out_proj."""

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        super().build(config, rngs)
        self.classifier = RobertaClassificationHead(self.args, dtype=self.dtype, rngs=rngs)

    @property
    def num_labels(self) -> int:
        return self.args.num_labels

    def pooling_head(self, pooled):
        return self.classifier(pooled).astype(jnp.float32)
