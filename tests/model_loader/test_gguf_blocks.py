"""GGUF weights kept in their blocks (``--quantization gguf``; a .gguf file is dequantized without it)
against the same file dequantized to float (``--quantization none``).

A tiny Llama (tied embedding, so the LM head runs through the kernel too) is written by the
``gguf`` package's quantizer for each 32-value kernel type, and a 256-wide one as a K-quant mix
(Q4_K, Q5_K and Q6_K Linears, a Q6_K embedding and LM head, one Q8_0 Linear: the shape of
llama.cpp's Q4_K_M files; the blocks by tests/helpers/kquants.py, since the gguf package cannot
write K-quants). Both models run the same teacher-forced
tokens: a prefill of three prompts in one 40-token step, then 20 decode steps of 4 rows, both
through the C++ kernel (activations rounded to int8 per block of 32, as llama.cpp does; below
F32_MIN_ROWS rows; the XLA branch from there is test_product_branches). Tolerances, as fractions
of the float model's logit range at a position:
  * within 5% (seen: <= 3.5%, K-quants 2.9%); next-token top-1 agrees at >= 99% of the positions whose
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

import jax
import jax.numpy as jnp
from gguf_writer import write_gguf
from jaxlm.attention.backends import cpu_kernels_unavailable, get_attention_backend
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import get_model, resolve_model_config
from jaxlm.models import get_model_architecture
from jaxlm.models.quantization.gguf_product import gguf_product
from kernels_cpu.gguf_matmul import F32_MIN_ROWS, from_kernel_layout, gguf_matmul_reference, to_kernel_layout
from tests.models._parity import JaxRunner

_Q = gguf.GGMLQuantizationType
KERNEL_TYPES = [_Q.Q8_0, _Q.Q4_0, _Q.Q4_1]


def k_mix(name: str) -> gguf.GGMLQuantizationType:
    """The K-quant mix's type of each 2-D tensor (HF name)."""
    if "embed_tokens" in name or "layers.1.mlp.down_proj" in name:
        return _Q.Q6_K
    if "layers.1.self_attn.o_proj" in name:
        return _Q.Q8_0
    return _Q.Q5_K if any(p in name for p in ("v_proj", "o_proj", "down_proj")) else _Q.Q4_K


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


@pytest.fixture(scope="module")
def tiny_tied_256(tmp_path_factory) -> str:
    """As tiny_tied, 256 wide (the K-quants' rows are whole super-blocks of 256)."""
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tied256") / "llama", tie_word_embeddings=True,
                           hidden_size=256, intermediate_size=512, initializer_range=0.1)


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


@pytest.mark.parametrize("quant", [*KERNEL_TYPES, k_mix], ids=[*(q.name for q in KERNEL_TYPES), "K-quants"])
def test_blocks_match_dequantized_model(request, tmp_path, quant):
    hf_dir = request.getfixturevalue("tiny_tied_256" if quant is k_mix else "tiny_tied")
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    type_of = quant if quant is k_mix else lambda _: quant
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf_dir, path, cfg, quant)
    blocks, hf_cfg = _load(path, "gguf")
    floats, _ = _load(path, "none")
    # The blocks are the file's bytes, not floats: each Linear and the embedding hold uint8.
    q_proj = blocks.model.layers[0].self_attn.q_proj
    assert q_proj.qweight[...].dtype == np.uint8 and not hasattr(q_proj, "weight")
    # The embedding holds the file's bytes (in the kernel's layout: the rows interleaved by 16 for
    # the 32-value types), and gives them back exactly.
    etype = type_of("model.embed_tokens.weight")
    file_blocks = next(t.data for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    held = blocks.model.embed_tokens.qweight[...]
    assert held.size == np.asarray(file_blocks).size
    np.testing.assert_array_equal(np.asarray(from_kernel_layout(held, int(etype), cfg.vocab_size)),
                                  np.asarray(file_blocks).reshape(cfg.vocab_size, -1))
    kept = blocks.quant_config.describe()
    for name in {type_of(n).name for n in ("q_proj", "v_proj", "model.embed_tokens.weight", "layers.1.self_attn.o_proj")}:
        assert f"{name} x" in kept, kept
    rng = np.random.default_rng(7 if quant is k_mix else int(quant))
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (16, 13, 11)]
    follow = [list(rng.integers(3, cfg.vocab_size, 20)) for _ in prompts]
    got = _teacher_forced(blocks, hf_cfg, prompts, follow)
    want = _teacher_forced(floats, hf_cfg, prompts, follow)
    n_prefill = sum(map(len, prompts))
    spread = want.max(-1, keepdims=True) - want.min(-1, keepdims=True)
    rel = np.abs(got - want) / spread
    assert rel[:n_prefill].max() <= 0.05, f"prefill logits differ by {rel[:n_prefill].max():.2%} of their range"
    assert rel[n_prefill:].max() <= 0.05, f"decode logits differ by {rel[n_prefill:].max():.2%} of their range"
    top2 = np.sort(want, -1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 0.05 * spread[:, 0]
    same = got.argmax(-1) == want.argmax(-1)
    assert decided.sum() >= len(want) // 4, "the test model should decide many positions clearly"
    assert same[decided].mean() >= 0.99, f"top-1 agrees on {same[decided].mean():.1%} of {decided.sum()} decided positions"
    assert same.mean() >= 0.90, f"top-1 agrees on {same.mean():.1%} of {len(same)} positions"


@pytest.mark.parametrize("qtype", [_Q.Q4_1, _Q.Q5_K], ids=["Q4_1", "Q5_K"])
@pytest.mark.parametrize("rows", [F32_MIN_ROWS - 1, F32_MIN_ROWS])
def test_product_branches(rows, qtype):
    """gguf_product: below F32_MIN_ROWS rows the kernel on x rounded to int8 per block, from there
    XLA's dot on W dequantized in XLA (from the kernel layout: Q5_K's unpacked scales packed
    again) with x as given; each within 1e-5 of the largest |output| of the NumPy oracle fed the
    x its branch sees (the other branch's x misses by ~1%)."""
    from tests.helpers.kquants import quantize

    rng = np.random.default_rng(rows)
    k = 256 if qtype == _Q.Q5_K else 64
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = quantize(rng.standard_normal((9, k)).astype(np.float32), qtype)
    # 9 weight rows: the kernel layout pads them to a group of 16, which neither branch may return.
    kw = jnp.asarray(to_kernel_layout(w, int(qtype)))
    out = np.asarray(jax.jit(gguf_product, static_argnums=(2, 3))(jnp.asarray(x), kw, int(qtype), 9))
    want = gguf_matmul_reference(x, w, int(qtype), quantize_x=rows < F32_MIN_ROWS)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(want).max())


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


def test_llm_quantization_flag(tiny_tied_256, tmp_path, caplog):
    """``LLM(model=file.gguf, quantization="gguf")`` keeps the K-quant mix's tensors (and its
    Q8_0 one) in blocks and names their types in the start-up log, as it does without the flag
    (the file's own method, as vLLM takes it); with ``"none"`` the same file is served dequantized. The block engine's weights take about
    the file's bytes (in the kernel layout Q4_K 148, Q5_K 180, Q6_K 210 per 256 values, Q8_0 34
    per 32; float32: 4 per value).

    Teacher-forced through both engines: the block engine decodes 24 greedy tokens after each of
    two prompts (16 rows a step: the kernel's int8 path); the float engine reads prompt + those
    tokens (prompt_logprobs). Its top-1 is the block engine's token at >= 85% of the 48
    positions (seen: 93.8%, 3 flips) and, where it is not, the block engine's token is within 0.5
    of its top logit, a near tie (seen: <= 0.07; decode logits differ by <= 2.9% of a logit range
    of ~9.5 at a position, test_blocks_match_dequantized_model, and a flip needs the two within
    twice that)."""
    from jaxlm import LLM, SamplingParams

    cfg = transformers.AutoConfig.from_pretrained(tiny_tied_256)
    path = str(tmp_path / "tiny-K.gguf")
    write_gguf(tiny_tied_256, path, cfg, k_mix)
    engine = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, token_buckets=[16],
                  seq_buckets=[2], num_gpu_blocks_override=8)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 300, 7, 99, 3, 18, 250]]
    nbytes, generated = {}, []
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import resolve_model_config

    assert resolve_model_config(ModelConfig(model=path, tokenizer=tiny_tied_256), LoadConfig()).quantization == "gguf"
    for quantization in ("gguf", "none"):
        with caplog.at_level(logging.INFO, logger="jaxlm"):
            llm = LLM(model=path, tokenizer=tiny_tied_256, quantization=quantization, **engine)
        if quantization == "gguf":
            sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            generated = [o.outputs[0].token_ids for o in outs]
            assert all(len(g) == 24 for g in generated)
            line = [r.getMessage() for r in caplog.records if "quantization: gguf (" in r.getMessage()]
            assert line and all(f"{t} x" in line[-1] for t in ("Q4_K", "Q5_K", "Q6_K", "Q8_0")), line
        else:
            sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
            outs = llm.generate([{"prompt_token_ids": p + g} for p, g in zip(prompts, generated)], sp, use_tqdm=False)
            gaps = [max(lp.logprob for lp in pos.values()) - pos[tok].logprob
                    for o, p, g in zip(outs, prompts, generated)
                    for pos, tok in zip(o.prompt_logprobs[len(p):], g)]
            assert len(gaps) == 48
            agree = np.mean([gap == 0 for gap in gaps])
            assert agree >= 0.85 and max(gaps) <= 0.5, (agree, sorted(gaps)[-5:])
        params = llm.llm_engine.get_model_runner().params
        leaves = [v.get_value() for _, v in nnx.to_flat_state(params)]
        nbytes[quantization] = sum(x.nbytes for x in leaves)
        layers = params["model"]["layers"]
        for proj in (layers[0]["self_attn"]["q_proj"], layers[0]["mlp"]["down_proj"], layers[1]["mlp"]["down_proj"]):
            assert ("qweight" in proj) == (quantization == "gguf"), list(proj)
        del llm
    # the 2-D weights: 4.5-5.5 bits a value against float32's 32; the norms stay float32 in both
    assert nbytes["gguf"] < 0.2 * nbytes["none"], nbytes


def test_kquant_rows_not_whole_super_blocks_are_refused():
    """A K-quant tensor whose rows are not whole super-blocks of 256 (llama.cpp writes none: its
    quantizer picks another type there) is refused naming the tensor and the type, for a Linear
    and for the embedding; the loader refuses such a tensor in the file too."""
    from flax import nnx as _nnx

    from jaxlm.model_loader.errors import CorruptCheckpointError
    from jaxlm.model_loader.gguf_reader import GGUFTensorInfo
    from jaxlm.model_loader.gguf_utils import _blocks
    from jaxlm.models.layers import Embedding, Linear, ParallelStyle
    from jaxlm.models.quantization.gguf import GGUFConfig

    config = GGUFConfig((("model.embed_tokens.weight", 14), ("model.layers.0.mlp.down_proj.weight", 12)),
                        frozenset({12, 14}))
    down = Linear(320, 256, bias=False, parallel=ParallelStyle.ROW, dtype=np.float32, rngs=_nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight is Q4_K.*320, not a multiple of 256"):
        config.get_quant_method(down, "model.layers.0.mlp.down_proj")
    embed = Embedding(100, 128, dtype=np.float32, rngs=_nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight is Q6_K.*128, not a multiple of 256"):
        config.get_quant_method(embed, "model.embed_tokens")

    class _File:
        path = "broken.gguf"

    with pytest.raises(CorruptCheckpointError, match=r"'blk\.0\.ffn_down\.weight' .*not whole Q4_K blocks of 256"):
        _blocks(_File(), GGUFTensorInfo("blk.0.ffn_down.weight", (256, 320), 12, 0, 0))


def test_accelerator_plan_keeps_blocks_and_matches_the_dequantized_model(tiny_tied, tmp_path, monkeypatch):
    """Off XLA:CPU (the accelerator's plan, forced here) the blocks are kept with no C++ kernel:
    each product dequantizes them in XLA, so the logits equal the dequantized model's within
    1e-5 of their range (the same f32 weights; only the order of XLA's sums differs)."""
    from jaxlm.models.quantization import gguf as gguf_quant

    cfg = transformers.AutoConfig.from_pretrained(tiny_tied)
    path = str(tmp_path / "tiny-Q4_1.gguf")
    write_gguf(tiny_tied, path, cfg, _Q.Q4_1)
    monkeypatch.setattr(gguf_quant, "_block_plan_here", lambda: gguf_quant.block_plan("gpu", None))
    blocks, hf_cfg = _load(path, "gguf")
    floats, _ = _load(path, "none")
    q_proj = blocks.model.layers[0].self_attn.q_proj
    assert q_proj.qweight[...].dtype == np.uint8 and not q_proj.quant_method.cpu_kernel
    assert "dequantized in each product" in blocks.quant_config.describe()
    prompts, follow = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 300, 7]], [[12, 13], [14, 15]]
    got = _teacher_forced(blocks, hf_cfg, prompts, follow)
    want = _teacher_forced(floats, hf_cfg, prompts, follow)
    spread = want.max(-1, keepdims=True) - want.min(-1, keepdims=True)
    assert (np.abs(got - want) / spread).max() <= 1e-5
