"""GGUF weights kept in their blocks (``--quantization gguf``; a .gguf file is dequantized without it)
against the same file dequantized to float (``--quantization none``).

A tiny Llama (tied embedding, so the LM head runs through the kernel too) is written by the
``gguf`` package's quantizer for each kernel type. Both models run the same teacher-forced
tokens: a prefill of three prompts in one 48-token step (many rows: XLA's dot on the weight
dequantized in XLA), then 20 decode steps of 4 rows (the C++ kernel: activations rounded to int8
per block of 32, as llama.cpp does). Tolerances, as fractions of the float model's logit range at a position:
  * prefill: within 1e-4 (seen: 0: the same dot on the same float weights);
  * decode: within 5% (seen: <= 3.5%); next-token top-1 agrees at >= 99% of the positions whose
    float top-1 leads the runner-up by more than 5% of the range (seen: 100%) and at >= 90% of
    all (seen: 97-100%: a random model's top two logits are often nearly tied, and int8 rounding
    moves logits by ~1% of the range; the trained default model agrees at 99%+,
    tests/model_loader/test_loader_default_model.py).
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import transformers
from flax import nnx

from gguf_writer import write_gguf
from jaxlm.attention.backends import cpu_kernels_unavailable, get_attention_backend
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import get_model, resolve_model_config
from jaxlm.models import get_model_architecture
from tests.models._parity import JaxRunner

_Q = gguf.GGMLQuantizationType
KERNEL_TYPES = [_Q.Q8_0, _Q.Q4_0, _Q.Q4_1]


def _load(path: str, quantization: str):
    lc = LoadConfig()
    mc = resolve_model_config(ModelConfig(model=path, quantization=quantization), lc)
    model = get_model(mc, lc, attn_backend=get_attention_backend("xla"))
    return model, mc.hf_config


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import make_tiny_llama

    # Weights larger than the default init (std 0.02) so the logits have real margins.
    return make_tiny_llama(tmp_path_factory.mktemp("tied") / "llama", tie_word_embeddings=True, initializer_range=0.2)


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    why = cpu_kernels_unavailable()
    if why:
        pytest.skip(f"the C++ kernels cannot be built here: {why}")


def _teacher_forced(model, cfg, prompts: list[list[int]], follow: list[list[int]]) -> np.ndarray:
    """Logits at every position: the prompts prefilled in one step, then ``follow``'s tokens
    fed one step at a time."""
    runner = JaxRunner(model, cfg, get_model_architecture(cfg))
    out = [runner.run({i: p for i, p in enumerate(prompts)})]
    for step in range(len(follow[0])):  # 4 rows a step: the kernel's few-rows (int8) path
        out.append(runner.run({i: [f[step]] for i, f in enumerate(follow)}, token_bucket=4))
    return np.concatenate(out)


@pytest.mark.parametrize("quant", KERNEL_TYPES, ids=lambda q: q.name)
def test_blocks_match_dequantized_model(tiny_tied, tmp_path, quant, caplog):
    cfg = transformers.AutoConfig.from_pretrained(tiny_tied)
    path = str(tmp_path / f"tiny-{quant.name}.gguf")
    write_gguf(tiny_tied, path, cfg, quant)
    blocks, hf_cfg = _load(path, "gguf")
    floats, _ = _load(path, "none")
    # The blocks are the file's bytes, not floats: each Linear and the embedding hold uint8.
    q_proj = blocks.model.layers[0].self_attn.q_proj
    assert q_proj.qweight[...].dtype == np.uint8 and not hasattr(q_proj, "weight")
    assert blocks.model.embed_tokens.qweight[...].shape == (cfg.vocab_size, cfg.hidden_size // 32 * gguf.GGML_QUANT_SIZES[quant][1])
    rng = np.random.default_rng(int(quant))
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (16, 13, 11)]
    follow = [list(rng.integers(3, cfg.vocab_size, 20)) for _ in prompts]
    got = _teacher_forced(blocks, hf_cfg, prompts, follow)
    want = _teacher_forced(floats, hf_cfg, prompts, follow)
    n_prefill = sum(map(len, prompts))
    spread = want.max(-1, keepdims=True) - want.min(-1, keepdims=True)
    rel = np.abs(got - want) / spread
    assert rel[:n_prefill].max() <= 1e-4, f"prefill logits differ by {rel[:n_prefill].max():.2e} of their range"
    assert rel[n_prefill:].max() <= 0.05, f"decode logits differ by {rel[n_prefill:].max():.2%} of their range"
    top2 = np.sort(want, -1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 0.05 * spread[:, 0]
    same = got.argmax(-1) == want.argmax(-1)
    assert decided.sum() >= len(want) // 4, "the test model should decide many positions clearly"
    assert same[decided].mean() >= 0.99, f"top-1 agrees on {same[decided].mean():.1%} of {decided.sum()} decided positions"
    assert same.mean() >= 0.90, f"top-1 agrees on {same.mean():.1%} of {len(same)} positions"


def test_type_without_kernel_is_dequantized_with_one_log_line(tiny_tied, tmp_path, caplog):
    """An untied F16 LM head has no kernel (and is no Linear): it is dequantized at load, named
    in one log line, while the Q8_0 layers stay in blocks."""
    cfg = transformers.AutoConfig.from_pretrained(tiny_tied)
    path = str(tmp_path / "tiny-Q5_0.gguf")
    write_gguf(tiny_tied, path, cfg, _Q.Q5_0)  # no kernel for Q5_0: every 2-D tensor is dequantized
    with caplog.at_level(logging.INFO, logger="jaxlm"):
        model, _ = _load(path, "gguf")
    lines = [r.getMessage() for r in caplog.records if "without a kernel" in r.getMessage()]
    assert len(lines) == 1 and "Q5_0" in lines[0], lines
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight[...].dtype == np.float32 and not hasattr(q_proj, "qweight")


def test_llm_quantization_flag(tiny_tied, tmp_path):
    """``LLM(model=file.gguf, quantization="gguf")`` keeps the Q8_0 tensors in blocks;
    without the flag (or ``"none"``) the same file is served dequantized. Both generate; the block engine's
    weights take the file's bytes (Q8_0: 34 bytes per 32 values, float32: 128)."""
    from jaxlm import LLM, SamplingParams

    cfg = transformers.AutoConfig.from_pretrained(tiny_tied)
    path = str(tmp_path / "tiny-Q8_0.gguf")
    write_gguf(tiny_tied, path, cfg, _Q.Q8_0)
    engine = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, token_buckets=[16],
                  seq_buckets=[2], num_gpu_blocks_override=8)
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    nbytes = {}
    for quantization in ("gguf", None):
        llm = LLM(model=path, tokenizer=tiny_tied, quantization=quantization, **engine)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], sp, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6
        params = llm.llm_engine.get_model_runner().params
        leaves = [v.get_value() for _, v in nnx.to_flat_state(params)]
        nbytes[quantization] = sum(x.nbytes for x in leaves)
        q_proj = params["model"]["layers"][0]["self_attn"]["q_proj"]
        assert ("qweight" in q_proj) == (quantization == "gguf"), list(q_proj)
        del llm
    # the 2-D weights: 34/128 of float32's bytes; the norms stay float32 in both
    assert nbytes["gguf"] < 0.3 * nbytes[None], nbytes
