"""GGUF checkpoints: metadata → HF config, q/k unpermutation, F32 / Q8_0 dequantization."""

from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest
import transformers

from gguf_writer import permute, write_gguf
from loader_helpers import hf_tensors, load, param_as_hf
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import CorruptCheckpointError, resolve_model_config
from jaxlm.model_loader.gguf_utils import unpermute_qk

_Q = gguf.GGMLQuantizationType
F32, Q8_0 = _Q.F32, _Q.Q8_0
# Max abs error vs the source weights, as a fraction of the tensor's max |w|: Q8_0 rounds to
# 1/127 of a block's max (half a step: 1/254); the 4-bit types to about 1/15 of the block range.
_TOL = {_Q.F32: 0.0, _Q.F16: 1e-3, _Q.BF16: 1e-2, _Q.Q8_0: 1 / 127, _Q.Q4_0: 1 / 7, _Q.Q4_1: 1 / 7, _Q.Q5_0: 1 / 15}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory):
    cfg = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    out = str(tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf")
    return out, write_gguf(tiny_llama_dir, out, cfg, Q8_0), cfg


def test_unpermute_inverts_converter():
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    for heads in (1, 2, 6):
        np.testing.assert_array_equal(unpermute_qk(permute(w, heads), heads), w)
    assert not np.array_equal(permute(w, 2), w)


def test_config_from_metadata(tiny_gguf):
    path, _, cfg = tiny_gguf
    mc = resolve_model_config(ModelConfig(model=path), LoadConfig())
    got = mc.hf_config
    assert type(got).__name__ == "LlamaConfig" and got.architectures == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(got, key) == getattr(cfg, key), key
    assert got.rope_parameters["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert got.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert got.tie_word_embeddings is False  # output.weight present
    assert mc.dtype == "float32" and mc.max_model_len == cfg.max_position_embeddings


@pytest.mark.parametrize("quant", list(_TOL), ids=lambda q: q.name)
def test_llama_gguf_matches_reference(tiny_llama_dir, tmp_path, quant):
    cfg = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    path = str(tmp_path / f"tiny-{quant.name}.gguf")
    ref = write_gguf(tiny_llama_dir, path, cfg, quant)
    model = load(path, quantization="none")  # the dequantizer (blocks: test_gguf_blocks.py)
    hf = hf_tensors(tiny_llama_dir)
    for name, want in ref.items():
        got = param_as_hf(model, name)
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=name)  # exactly the file's values
        # and the HF model it came from, within the quantization error (Q8_0: scale/2 per block)
        tol = _TOL[quant] * np.abs(hf[name]).max() if want.ndim == 2 else 0.0
        np.testing.assert_allclose(got, hf[name], atol=tol, rtol=0, err_msg=name)


def test_qwen2_gguf_is_not_permuted(tmp_path):
    from tests.helpers.tiny_models import make_tiny_qwen2

    d = make_tiny_qwen2(tmp_path / "qwen2")
    cfg = transformers.AutoConfig.from_pretrained(d)
    path = str(tmp_path / "qwen2.gguf")
    ref = write_gguf(d, path, cfg, F32, arch="qwen2")
    mc = resolve_model_config(ModelConfig(model=path), LoadConfig())
    assert type(mc.hf_config).__name__ == "Qwen2Config"
    model = load(path, quantization="none")  # the dequantizer (blocks: test_gguf_blocks.py)
    hf = hf_tensors(d)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        np.testing.assert_array_equal(param_as_hf(model, name), hf[name])
        np.testing.assert_array_equal(ref[name], hf[name])


def test_gguf_directory_and_truncated(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    data = open(path, "rb").read()
    d = tmp_path / "dir"
    d.mkdir()
    (d / "model.gguf").write_bytes(data)
    load(str(d))  # a directory holding one .gguf
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(str(bad))}: corrupt or truncated checkpoint"):
        load(str(bad))


def test_export_gguf_to_safetensors(tiny_gguf, tmp_path):
    """GGUF → HF safetensors directory (sharded) with jaxlm's exporter; both load to the same params."""
    from jaxlm.model_loader.export import export_safetensors
    from jaxlm.model_loader.gguf_utils import iterate_gguf_weights, open_gguf

    path, ref, _ = tiny_gguf
    hf_config = resolve_model_config(ModelConfig(model=path), LoadConfig()).hf_config
    out = str(tmp_path / "hf")
    files = export_safetensors(iterate_gguf_weights(open_gguf(path), path), out, hf_config, max_shard_bytes=64 << 10)
    assert len(files) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    # transformers reads the exported directory too
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    name = "model.layers.1.self_attn.k_proj.weight"
    np.testing.assert_array_equal(hf.state_dict()[name].numpy(), ref[name])
    model = load(out, quantization="none")  # the dequantizer (blocks: test_gguf_blocks.py)
    for name, want in ref.items():
        np.testing.assert_array_equal(param_as_hf(model, name), want, err_msg=name)


@pytest.mark.parametrize("qtype", [_Q.Q4_K, _Q.Q6_K, _Q.Q5_K, _Q.Q4_0, _Q.BF16], ids=lambda q: q.name)
def test_k_quant_bytes_dequantize_like_gguf(tmp_path, qtype):
    """K-quants cannot be produced in numpy; write raw blocks and check our reader's byte/shape logic."""
    from jaxlm.model_loader.gguf_reader import GGUFFile
    from jaxlm.model_loader.gguf_utils import _tensor_array

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * 256
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * type_size), dtype=np.uint8)
    if qtype == _Q.BF16:
        raw = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32).view(np.uint32)
        raw = (raw >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    path = str(tmp_path / "q.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    (info,) = f.tensors
    assert info.shape == (rows, cols)
    got = _tensor_array(f, info).astype(np.float32)
    want = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    np.testing.assert_array_equal(got, want)


def _fake_reader(fields: dict, tensor_names=("token_embd.weight",)):
    import types

    return types.SimpleNamespace(fields=fields, tensors=[types.SimpleNamespace(name=n, qtype=8) for n in tensor_names])


_QWEN2_FIELDS = {
    "general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.feed_forward_length": 128,
    "qwen2.block_count": 2, "qwen2.attention.head_count": 4, "qwen2.vocab_size": 100,
}


def test_config_table_defaults_and_per_arch_fields():
    from jaxlm.model_loader.gguf_utils import gguf_config_dict

    cfg = gguf_config_dict(_fake_reader(_QWEN2_FIELDS), "x.gguf")
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert (cfg["num_key_value_heads"], cfg["max_position_embeddings"], cfg["rms_norm_eps"]) == (4, 2048, 1e-6)
    assert cfg["tie_word_embeddings"] is True and "head_dim" not in cfg and "attention_bias" not in cfg
    # every tensor's GGML type, for --quantization gguf (8: Q8_0)
    assert cfg["quantization_config"] == {"quant_method": "gguf", "tensor_types": {"model.embed_tokens.weight": 8}}
    llama = {k.replace("qwen2.", "llama."): v for k, v in _QWEN2_FIELDS.items()}
    llama["general.architecture"] = "llama"
    cfg = gguf_config_dict(_fake_reader(llama, ("output.weight", "blk.0.attn_q.bias")), "x.gguf")
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["head_dim"], cfg["attention_bias"], cfg["tie_word_embeddings"]) == (16, True, False)


def test_config_missing_required_key_or_unknown_arch_is_named():
    from jaxlm.model_loader import UnsupportedModelError
    from jaxlm.model_loader.gguf_utils import gguf_config_dict

    fields = {k: v for k, v in _QWEN2_FIELDS.items() if k != "qwen2.block_count"}
    with pytest.raises(CorruptCheckpointError, match=r"x\.gguf.*qwen2\.block_count"):
        gguf_config_dict(_fake_reader(fields), "x.gguf")
    with pytest.raises(UnsupportedModelError, match="'falcon'.*llama, qwen2"):
        gguf_config_dict(_fake_reader({"general.architecture": "falcon"}), "x.gguf")


def test_phi3_gguf_fused_tensors_and_longrope(tmp_path):
    """Phi-3 as llama.cpp writes it: fused attn_qkv / ffn_up, the rotary share as a dimension
    count, longrope's factors as two tensors. Same Params and the same rope as the HF checkpoint."""
    from jaxlm.models.rotary import RotaryEmbedding
    from tests.helpers.tiny_models import make_tiny_model

    d = make_tiny_model("phi3", tmp_path / "phi3", num_key_value_heads=1)
    cfg = transformers.AutoConfig.from_pretrained(d)
    path = str(tmp_path / "phi3.gguf")
    write_gguf(d, path, cfg, F32, arch="phi3")
    got = resolve_model_config(ModelConfig(model=path), LoadConfig()).hf_config
    assert type(got).__name__ == "Phi3Config" and got.sliding_window is None
    for max_len in (16, 256):  # short and long factors (stored as F32), the same attention factor
        a, b = (RotaryEmbedding.from_config(c, 16, max_model_len=max_len) for c in (got, cfg))
        assert (a.theta, a.rope_type, a.rotary_dim) == (b.theta, b.rope_type, 8)
        np.testing.assert_allclose(dict(a.fields)["ext_factors"], dict(b.fields)["ext_factors"], rtol=1e-7)
        assert a.mscale == pytest.approx(b.mscale, rel=1e-7)
    model = load(path, quantization="none")  # the dequantizer (blocks: test_gguf_blocks.py)
    hf = hf_tensors(d)
    q, kv = 64, 16  # 4 query heads and 1 KV head of 16
    qkv, gate_up = hf["model.layers.1.self_attn.qkv_proj.weight"], hf["model.layers.1.mlp.gate_up_proj.weight"]
    for name, want in (("q_proj", qkv[:q]), ("k_proj", qkv[q:q + kv]), ("v_proj", qkv[q + kv:])):
        np.testing.assert_array_equal(param_as_hf(model, f"model.layers.1.self_attn.{name}.weight"), want)
    np.testing.assert_array_equal(param_as_hf(model, "model.layers.1.mlp.gate_proj.weight"), gate_up[:128])
    np.testing.assert_array_equal(param_as_hf(model, "model.layers.1.mlp.up_proj.weight"), gate_up[128:])


def test_gemma3_gguf_is_refused_saying_why():
    from jaxlm.model_loader import UnsupportedModelError
    from jaxlm.model_loader.gguf_utils import gguf_config_dict

    fields = {k.replace("qwen2.", "gemma3."): v for k, v in _QWEN2_FIELDS.items()}
    fields["general.architecture"] = "gemma3"
    with pytest.raises(UnsupportedModelError, match="x.gguf.*'gemma3'.*query_pre_attn_scalar.*safetensors"):
        gguf_config_dict(_fake_reader(fields), "x.gguf")
