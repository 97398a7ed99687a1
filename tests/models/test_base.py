"""What CausalLMBase gives every family: one constructor, the KV cache spec by name, the
decoder loop, tensor-parallel styles of the linears."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxlm.core.kv_cache_utils import KVCacheSpec
from jaxlm.models import get_param_partition_spec
from jaxlm.models.base import run_decoder_layers, split_layers
from jaxlm.models.gpt2 import GPT2LMHeadModel
from jaxlm.models.layers import Linear, ParallelStyle
from jaxlm.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from jaxlm.models.opt import OPTForCausalLM
from tests.helpers import tiny_models as tm


def _abstract(cls, config):
    return nnx.eval_shape(lambda: cls(config, dtype=jnp.float32, attn_backend=None, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize(
    "cls, config, want",
    [
        (LlamaForCausalLM, tm.tiny_config("llama", num_key_value_heads=2), KVCacheSpec(2, 2, 16)),
        (Qwen3ForCausalLM, tm.tiny_config("qwen3"), KVCacheSpec(2, 2, 32)),  # explicit head_dim
        (OPTForCausalLM, tm.tiny_config("opt", num_hidden_layers=3), KVCacheSpec(3, 4, 16)),
        (GPT2LMHeadModel, tm.tiny_config("gpt2", n_head=8), KVCacheSpec(2, 8, 8)),
    ],
    ids=["llama_gqa", "qwen3", "opt", "gpt2"],
)
def test_kv_cache_spec_from_config_matches_the_built_attention(cls, config, want):
    assert cls.get_kv_cache_spec(config) == want
    model = _abstract(cls, config)
    attns = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and hasattr(m, "head_dim")]
    assert len(attns) == want.num_layers
    for a in attns:
        assert (getattr(a, "num_kv_heads", a.num_heads), a.head_dim) == (want.num_kv_heads, want.head_dim)


def test_untied_lm_head_takes_the_embedding_width():
    # OPT with project_in/out: the head reads word_embed_proj_dim features, not hidden_size.
    model = _abstract(OPTForCausalLM, tm.tiny_config("opt", word_embed_proj_dim=32, tie_word_embeddings=False))
    assert model.lm_head.weight.get_value().shape == (32, tm.VOCAB_SIZE)
    tied = _abstract(OPTForCausalLM, tm.tiny_config("opt"))
    assert tied.lm_head is None and "lm_head.weight" not in tied.expected_weight_names()


def test_decoder_loop_threads_each_layer_its_own_cache():
    calls = []

    def layer(tag):
        def run(x, positions, cache, md):
            calls.append((tag, cache))
            return x + 1, cache + [tag]

        return run

    x, caches = run_decoder_layers([layer("a"), layer("b")], 0, None, [["ca"], ["cb"]], None)
    assert x == 2 and caches == [["ca", "a"], ["cb", "b"]]
    assert calls == [("a", ["ca"]), ("b", ["cb"])]


@pytest.mark.parametrize(
    "style, weight, bias",
    [
        (ParallelStyle.COLUMN, P(None, "model"), P("model")),
        (ParallelStyle.ROW, P("model", None), P(None)),
        (ParallelStyle.REPLICATED, P(None, None), P(None)),
    ],
)
def test_parallel_style_specs(style, weight, bias):
    lin = nnx.eval_shape(lambda: Linear(8, 4, bias=True, parallel=style, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    assert get_param_partition_spec(lin.weight) == weight
    assert get_param_partition_spec(lin.bias) == bias


def test_split_layers_contiguous_first_stages_one_more():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert split_layers(3, 1) == [range(0, 3)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=5.*num_hidden_layers=4"):
        split_layers(4, 5)
