"""safetensors checkpoints: single file, sharded, bf16, dtype placement."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from loader_helpers import hf_tensors, load, param_as_hf
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import resolve_model_config
from jaxlm.model_loader.safetensors_utils import iterate_safetensors_file, write_safetensors


def _assert_matches(model, ref: dict[str, np.ndarray], atol=0.0) -> None:
    for name, want in ref.items():
        got = param_as_hf(model, name)
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=atol, rtol=0, err_msg=name)


def test_single_file_equals_hf_weights(tiny_llama_dir):
    model = load(tiny_llama_dir)
    ref = hf_tensors(tiny_llama_dir)
    assert len(ref) == len(model.expected_weight_names())
    _assert_matches(model, ref)


def test_sharded_checkpoint(tiny_llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    out = tmp_path / "sharded"
    hf.save_pretrained(out, safe_serialization=True, max_shard_size="40KB")
    shards = [n for n in os.listdir(out) if n.endswith(".safetensors")]
    assert len(shards) > 2 and (out / "model.safetensors.index.json").exists()
    model = load(str(out))
    _assert_matches(model, hf_tensors(tiny_llama_dir))


def test_single_safetensors_file_path(tiny_llama_dir):
    model = load(os.path.join(tiny_llama_dir, "model.safetensors"))
    _assert_matches(model, hf_tensors(tiny_llama_dir))


def test_bf16_checkpoint_and_dtype_placement(tiny_llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    out = tmp_path / "bf16"
    hf.save_pretrained(out, safe_serialization=True)
    ref = {k: v.astype(np.float32) for k, v in
           ((n, a) for n, a in iterate_safetensors_file(str(out / "model.safetensors")))}
    assert all(a.dtype == np.float32 for a in ref.values())
    # auto on CPU: float32 even though the checkpoint says bfloat16
    model = load(str(out))
    assert param_as_hf(model, "model.norm.weight").dtype == np.float32
    _assert_matches(model, ref)
    # explicit bfloat16 is honoured in placement, values exact (bf16 → bf16)
    model16 = load(str(out), dtype="bfloat16")
    assert param_as_hf(model16, "model.layers.0.mlp.up_proj.weight").dtype == ml_dtypes.bfloat16
    _assert_matches(model16, ref)


def test_reader_roundtrip_bf16(tmp_path):
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
               "b": np.ones((4,), np.int64), "c": np.zeros((0, 3), np.float16)}
    write_safetensors(str(tmp_path / "x.safetensors"), tensors)
    back = dict(iterate_safetensors_file(str(tmp_path / "x.safetensors")))
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)
    # and the reference library reads what we write
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(load_file(str(tmp_path / "x.safetensors"))["b"], tensors["b"])


def test_resolve_safetensors_config(tiny_llama_dir):
    mc = resolve_model_config(ModelConfig(model=tiny_llama_dir), LoadConfig())
    assert mc.hf_config.model_type == "llama" and mc.dtype == "float32"
    assert mc.max_model_len == 256  # min(max_position_embeddings=256, 2048 on CPU)
    assert resolve_model_config(ModelConfig(model=tiny_llama_dir, max_model_len=100), LoadConfig()).max_model_len == 100
    with pytest.raises(ValueError, match=r"max_model_len=4096 is larger than the model's maximum context.*256"):
        resolve_model_config(ModelConfig(model=tiny_llama_dir, max_model_len=4096), LoadConfig())
    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"


def test_reader_streams_one_tensor_at_a_time(tmp_path):
    import tracemalloc

    n, shape = 6, (512, 1024)  # 2 MiB each
    path = str(tmp_path / "big.safetensors")
    write_safetensors(path, {f"w{i}": np.full(shape, i, np.float32) for i in range(n)})
    one = np.zeros(shape, np.float32).nbytes
    tracemalloc.start()
    try:
        for name, arr in iterate_safetensors_file(path):
            assert arr[0, 0] == int(name[1:])
            del arr
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * one, f"peak {peak} bytes while reading tensors of {one} bytes"
