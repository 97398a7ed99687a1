"""LLM(kv_cache_dtype=...) on a tiny Llama: what fp8 KV buys in blocks, that its scales (the
checkpoint's, or the first batch's) are the ones used, and prefix hits on it. Its accuracy is
measured on a trained model: tests/entrypoints/test_kv_fp8_accuracy.py.

Three engines on the same weights and the same --kv-cache-memory-bytes: the float32 cache
("auto"), fp8 (e4m3) with the checkpoint's k_scale / v_scale, and fp8 with
--calculate-kv-scales on a checkpoint that ships none."""

from __future__ import annotations

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxlm import LLM, SamplingParams
from jaxlm.attention.kv_quant import kv_scale_leaf_index, quantize_fp8
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.timeout(600)

# K_SCALE / V_SCALE shipped in the checkpoint (as fp8 checkpoints do: self_attn.k_scale).
K_SCALE, V_SCALE = 0.02, 0.015
# f32 bytes of one block of the tiny Llama: K+V x 2 layers x 16 tokens x 2 KV heads x 16 dims x 4.
F32_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
KV_BYTES = 48 * F32_BLOCK_BYTES  # a whole number of f32 blocks: fp8 holds exactly 4x
NUM_PROMPTS = 16


def _engine(path: str, **kw) -> LLM:
    return LLM(path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, token_buckets=[16, 64],
               seq_buckets=[8], kv_cache_memory_bytes=KV_BYTES, seed=0, **kw)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    plain = make_tiny_llama(tmp_path_factory.mktemp("plain"))
    scaled = str(tmp_path_factory.mktemp("scaled"))
    shutil.copytree(plain, scaled, dirs_exist_ok=True)
    file = os.path.join(scaled, "model.safetensors")
    tensors = load_file(file)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(K_SCALE, np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(V_SCALE, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    return plain, scaled


@pytest.fixture(scope="module")
def f32_llm(paths):
    return _engine(paths[0])


@pytest.fixture(scope="module")
def fp8_llm(paths):
    return _engine(paths[1], kv_cache_dtype="fp8")


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 259, int(rng.integers(4, 40))).tolist() for _ in range(NUM_PROMPTS)]


def _greedy(llm: LLM, prompts, n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def _runner(llm: LLM):
    return llm.llm_engine.get_model_runner()


def _fp8_values(cache) -> np.ndarray:
    """An engine's fp8 cache (its bytes) as the e4m3 values it holds."""
    return np.asarray(jax.lax.bitcast_convert_type(cache, jnp.float8_e4m3fn).astype(jnp.float32))


def _scales(llm: LLM) -> list[float]:
    runner = _runner(llm)
    return [float(runner._param_leaves[i]) for i in kv_scale_leaf_index(runner.params)]


def test_checkpoint_scales_are_read_and_applied(f32_llm, fp8_llm):
    """First in the module: both engines fresh, so one prompt lands in the same blocks of each."""
    assert _scales(fp8_llm) == pytest.approx([K_SCALE, V_SCALE] * 2)
    prompt = _prompts()[0]
    for llm in (f32_llm, fp8_llm):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    f32 = np.asarray(_runner(f32_llm).kv_caches[0])
    fp8 = _fp8_values(_runner(fp8_llm).kv_caches[0])
    used = np.flatnonzero(np.abs(f32).reshape(2, f32.shape[1], -1).max(axis=(0, 2)) > 0)
    assert len(used) == -(-len(prompt) // 16)
    # Layer 0's K/V depend on the embedding alone: the fp8 cache holds the float cache's values
    # divided by the checkpoint's scales, rounded to e4m3 (a rounding step apart at most where the
    # two programs' f32 values differ in the last bit).
    for half, scale in ((0, K_SCALE), (1, V_SCALE)):
        want = np.asarray(quantize_fp8(jnp.asarray(f32[half, used]), scale, jnp.float8_e4m3fn).astype(jnp.float32))
        got = fp8[half, used]
        assert np.mean(got == want) > 0.99
        np.testing.assert_allclose(got, want, rtol=0.07, atol=2.0 ** -9)


def test_fp8_holds_4x_the_blocks_of_float32_and_says_so(f32_llm, fp8_llm):
    f32_blocks = f32_llm.llm_engine.engine_config.cache_config.num_gpu_blocks
    fp8_blocks = fp8_llm.llm_engine.engine_config.cache_config.num_gpu_blocks
    assert f32_blocks == KV_BYTES // F32_BLOCK_BYTES == 48
    assert fp8_blocks == 4 * f32_blocks
    assert _runner(fp8_llm).kv_caches[0].dtype == jnp.uint8  # fp8 kept as its bytes (kv_quant.storage_dtype)
    assert _runner(f32_llm).kv_caches[0].dtype == jnp.float32
    info = {m.name: m for m in fp8_llm.get_metrics()}["vllm:cache_config_info"]
    assert info.labels["cache_dtype"] == "fp8" and info.labels["num_gpu_blocks"] == str(fp8_blocks)


def test_prefix_hits_on_fp8_give_the_tokens_of_a_fresh_prompt(fp8_llm):
    prompt = _prompts()[1] + list(range(40, 80))  # > 2 blocks: a prefix hit covers whole blocks
    fresh = _greedy(fp8_llm, [prompt], 24)[0]
    hits0 = fp8_llm.llm_engine.get_stats()["prefix_cache_hits"]
    again = _greedy(fp8_llm, [prompt], 24)[0]
    # The second run read the first one's fp8 blocks (all whole blocks of the prompt but its last token).
    assert fp8_llm.llm_engine.get_stats()["prefix_cache_hits"] - hits0 == (len(prompt) - 1) // 16 * 16
    assert again == fresh


def test_calculate_kv_scales_from_the_first_batch(paths):
    llm = _engine(paths[0], kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert _scales(llm) == [0.0] * 4  # not computed yet
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(_prompts()[:4]):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    engine.step()  # the first batch: one prefill step
    scales = _scales(llm)
    assert all(s > 0 for s in scales)
    # Each layer's scale is its first batch's max|K| / 200 (max|V| / 100), so that batch's largest
    # element is stored as e4m3's nearest to 200 (192 or 208: 200 is a tie, and x / (x / 200) may
    # be an ulp either side) and to 100 (96 or 104), in every layer.
    for cache in _runner(llm).kv_caches:
        stored = np.abs(_fp8_values(cache))
        assert stored[0].max() in (192.0, 208.0) and stored[1].max() in (96.0, 104.0)
    while engine.has_unfinished_requests():
        engine.step()
    _greedy(llm, _prompts()[8:], 4)
    assert _scales(llm) == scales  # the first batch's, kept
    assert _runner(llm).num_compiles_after_warmup == 0


def test_bad_kv_cache_dtype_is_refused_with_the_choices(paths):
    with pytest.raises(Exception, match="auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2"):
        LLM(paths[0], kv_cache_dtype="int4")
    with pytest.raises(Exception, match="calculate_kv_scales needs an fp8"):
        LLM(paths[0], calculate_kv_scales=True)


def test_no_scales_in_the_checkpoint_logs_1_0_once(paths, caplog):
    from jaxlm.attention.backends import get_attention_backend
    from jaxlm.attention.kv_quant import KVQuant
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import get_model

    backend = get_attention_backend("xla", kv_quant=KVQuant(jnp.dtype(jnp.float8_e4m3fn)))
    with caplog.at_level(logging.WARNING, logger="jaxlm.attention.kv_quant"):
        model = get_model(ModelConfig(model=paths[0]), LoadConfig(), attn_backend=backend)
    warnings = [r for r in caplog.records if "k_scale/v_scale" in r.getMessage()]
    assert len(warnings) == 1 and "using 1.0" in warnings[0].getMessage()
    assert [float(m.self_attn.k_scale.get_value()) for m in model.model.layers] == [1.0, 1.0]
