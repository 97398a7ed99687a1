"""load_weights / expected_weight_names: names, legacy spellings, errors, dtype, abstract init."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file

from jaxlm.attention.backends import get_attention_backend
from jaxlm.model_loader.errors import UnexpectedWeightError, WeightLoadError, WeightShapeError
from jaxlm.models import get_model_architecture
from tests.helpers import tiny_models as tm

FAMILIES = {
    "llama": dict(),
    "llama_tied": dict(tie_word_embeddings=True),
    "mistral": dict(),
    "qwen2": dict(),
    "qwen3": dict(),
    "opt": dict(word_embed_proj_dim=32),
    "gpt2": dict(),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        name: tm.make_tiny_model(name.split("_")[0], root / name, **kw) for name, kw in FAMILIES.items()
    }


def _abstract(path: str, dtype=jnp.float32):
    config = transformers.AutoConfig.from_pretrained(path)
    cls = get_model_architecture(config)
    model = nnx.eval_shape(
        lambda: cls(config, dtype=dtype, attn_backend=get_attention_backend("xla"), rngs=nnx.Rngs(0))
    )
    return model, load_file(os.path.join(path, "model.safetensors"))


def _params(model):
    return {".".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_expected_names_equal_checkpoint_and_every_param_is_filled(tiny_dirs, family) -> None:
    model, weights = _abstract(tiny_dirs[family])
    params = _params(model)
    # Abstract construction allocates nothing.
    assert all(isinstance(p.get_value(), jax.ShapeDtypeStruct) for p in params.values())
    assert model.expected_weight_names() == set(weights)
    assert ("lm_head.weight" in weights) == (not model.tie_word_embeddings)
    loaded = model.load_weights(weights.items())
    assert loaded == set(weights)
    for name, p in params.items():
        v = p.get_value()
        assert isinstance(v, jax.Array), name
        assert v.dtype == jnp.float32, name


def test_weights_land_in_our_layout(tiny_dirs) -> None:
    model, weights = _abstract(tiny_dirs["llama"])
    model.load_weights(weights.items())
    attn = model.model.layers[1].self_attn
    # torch Linear [out, in] -> ours [in, out]
    np.testing.assert_array_equal(np.asarray(attn.q_proj.weight[...]), weights["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.lm_head.weight[...]), weights["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.model.embed_tokens.weight[...]), weights["model.embed_tokens.weight"])


def test_gpt2_fused_c_attn_is_split_into_q_k_v(tiny_dirs) -> None:
    model, weights = _abstract(tiny_dirs["gpt2"])
    model.load_weights(weights.items())
    n = model.args.hidden_size
    w = weights["transformer.h.0.attn.c_attn.weight"]
    b = weights["transformer.h.0.attn.c_attn.bias"]
    attn = model.transformer.h[0].attn
    for j, lin in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
        np.testing.assert_array_equal(np.asarray(lin.weight[...]), w[:, j * n : (j + 1) * n])
        np.testing.assert_array_equal(np.asarray(lin.bias[...]), b[j * n : (j + 1) * n])


@pytest.mark.parametrize(
    "family,rename",
    [
        ("gpt2", lambda n: n.removeprefix("transformer.")),  # openai-community/gpt2 spelling
        ("opt", lambda n: n.removeprefix("model.")),  # facebook/opt-* spelling
    ],
)
def test_legacy_checkpoint_names(tiny_dirs, family, rename) -> None:
    model, weights = _abstract(tiny_dirs[family])
    legacy = {rename(k): v for k, v in weights.items()}
    assert set(legacy) != set(weights)
    assert model.load_weights(legacy.items()) == model.expected_weight_names()


def test_known_buffers_are_skipped(tiny_dirs) -> None:
    model, weights = _abstract(tiny_dirs["llama_tied"])
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(8, np.float32),
        # Some tied checkpoints still carry the head; it is the embedding, so it is skipped.
        "lm_head.weight": weights["model.embed_tokens.weight"],
    }
    loaded = model.load_weights(list(weights.items()) + list(extra.items()))
    assert set(extra) <= loaded
    g_model, g_weights = _abstract(tiny_dirs["gpt2"])
    causal = np.tril(np.ones((1, 1, 256, 256), bool))
    g_extra = {"h.0.attn.bias": causal, "transformer.h.1.attn.masked_bias": np.float32(-1e4)}
    loaded = g_model.load_weights(list(g_weights.items()) + list(g_extra.items()))
    assert loaded >= g_model.expected_weight_names()


def test_unexpected_weight_names_the_tensor_and_the_source(tiny_dirs) -> None:
    model, weights = _abstract(tiny_dirs["llama"])
    bad = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(UnexpectedWeightError) as e:
        model.load_weights([(bad, np.zeros((4, 4), np.float32))])
    assert bad in str(e.value) and "<checkpoint>" in str(e.value)
    assert e.value.name == bad
    with pytest.raises(UnexpectedWeightError, match="shard-3.safetensors"):
        model.load_weights([("model.layers.7.mlp.up_proj.weight", np.zeros(1))], source="shard-3.safetensors")


def test_wrong_shape_names_both_shapes_in_hf_layout(tiny_dirs) -> None:
    model, weights = _abstract(tiny_dirs["llama"])
    name = "model.layers.0.self_attn.k_proj.weight"
    expected = weights[name].shape  # HF [out, in] = (2 * 16, 64)
    assert expected == (32, 64)
    with pytest.raises(WeightShapeError) as e:
        model.load_weights([(name, np.zeros((64, 32), np.float32))], source="model.safetensors")
    msg = str(e.value)
    assert "model.safetensors" in msg and name in msg
    assert "(64, 32)" in msg and "(32, 64)" in msg
    assert isinstance(e.value, WeightLoadError)


def test_bfloat16_weights_are_converted_on_load(tiny_dirs) -> None:
    model, weights = _abstract(tiny_dirs["qwen3"], dtype=jnp.bfloat16)
    model.load_weights(weights.items())
    for name, p in _params(model).items():
        assert p.get_value().dtype == jnp.bfloat16, name
    w = weights["model.layers.0.self_attn.q_norm.weight"]
    got = np.asarray(model.model.layers[0].self_attn.q_norm.weight[...]).astype(np.float32)
    np.testing.assert_allclose(got, w, rtol=1e-2)


def test_model_constructed_eagerly_runs_with_random_weights() -> None:
    # Engines may build a model without a checkpoint (dummy weights): it must run.
    from tests.helpers.paged_batch import PagedBatchBuilder, make_kv_caches

    config = tm.tiny_config("qwen3")
    cls = get_model_architecture(type("C", (), {"architectures": ["Qwen3ForCausalLM"]}))
    model = cls(config, dtype=jnp.float32, attn_backend=get_attention_backend("xla"), rngs=nnx.Rngs(0))
    pb = PagedBatchBuilder(16, 4, 4)
    ids, pos, md = pb.step({0: [5, 6, 7]})
    h, caches = model(ids, pos, make_kv_caches(cls.get_kv_cache_spec(config), 16, 4), md)
    assert h.shape == (3, 64)
    logits = model.compute_logits(h)
    assert logits.shape == (3, config.vocab_size) == (3, 320) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all() and float(jnp.abs(caches[0]).sum()) > 0
