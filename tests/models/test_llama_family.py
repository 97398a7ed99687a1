"""Llama / Mistral / Qwen2 / Qwen3 logits and greedy tokens equal transformers' (float32)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import tiny_models as tm
from tests.models._parity import assert_parity, run_parity

PROMPT_LENS = (5, 11, 17)


def _prompts(seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lens]


CASES = {
    # name: (maker, config overrides, prefill chunk or None)
    "llama_gqa_untied": (tm.make_tiny_llama, {}, None),
    "llama_mqa_tied": (tm.make_tiny_llama, dict(num_key_value_heads=1, tie_word_embeddings=True), None),
    "llama_mha_biases": (tm.make_tiny_llama, dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True), None),
    "llama_head_dim_8": (tm.make_tiny_llama, dict(num_attention_heads=8, num_key_value_heads=2), None),
    "llama3_rope_scaling": (tm.make_tiny_llama3, {}, None),
    "llama_chunked_prefill": (tm.make_tiny_llama, {}, 4),
    "mistral_sliding_window": (tm.make_tiny_mistral, {}, None),
    "mistral_sliding_window_chunked": (tm.make_tiny_mistral, dict(sliding_window=6), 5),
    "qwen2_qkv_bias": (tm.make_tiny_qwen2, {}, None),
    "qwen2_sliding_window_upper_layers": (
        tm.make_tiny_qwen2,
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
        None,
    ),
    "qwen2_tied": (tm.make_tiny_qwen2, dict(tie_word_embeddings=True, num_key_value_heads=1), None),
    "qwen3_qk_norm_head_dim": (tm.make_tiny_qwen3, {}, None),
    "qwen3_tied": (tm.make_tiny_qwen3, dict(tie_word_embeddings=True), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_parity(case: str, tmp_path, record_property) -> None:
    maker, overrides, chunk = CASES[case]
    path = maker(tmp_path / case, **overrides)
    res = run_parity(path, _prompts(), steps=32, chunk=chunk)
    assert_parity(res, case, record_property)


def test_bfloat16_model_keeps_its_dtype_and_tracks_float32(tmp_path) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tests.helpers.paged_batch import PagedBatchBuilder, make_kv_caches
    from tests.models._parity import build_model

    path = tm.make_tiny_qwen3(tmp_path / "q3", with_tokenizer=False)
    out = {}
    for dt in (jnp.float32, jnp.bfloat16):
        model, config, cls = build_model(path, dtype=dt)
        ids, pos, md = PagedBatchBuilder(32, 4, 8).step({0: list(range(3, 20))})
        caches = make_kv_caches(cls.get_kv_cache_spec(config), 32, 4, dt)
        graphdef, state = nnx.split(model)

        @jax.jit
        def step(state, ids, pos, caches, md):
            m = nnx.merge(graphdef, state)
            h, caches = m(ids, pos, caches, md)
            return h, m.compute_logits(h), caches

        h, logits, caches = step(state, ids, pos, caches, md)
        assert h.dtype == dt and caches[0].dtype == dt  # no silent promotion to float32
        assert logits.dtype == jnp.float32
        out[dt] = np.asarray(logits)
    ref = out[jnp.float32]
    assert np.abs(out[jnp.bfloat16] - ref).max() < 0.05 * np.abs(ref).max()
