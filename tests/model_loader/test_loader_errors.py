"""Every load error names the file (and the tensor) in its message."""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from loader_helpers import load
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import (
    CorruptCheckpointError,
    MissingWeightsError,
    NoWeightsError,
    UnexpectedWeightError,
    UnsupportedDtypeError,
    UnsupportedModelError,
    WeightLoadError,
    WeightShapeError,
    get_model,
    resolve_model_config,
)

Q = "model.layers.1.self_attn.q_proj.weight"


def _rewrite(path: str, edit) -> str:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return f


def test_missing_weight(tiny_copy):
    _rewrite(tiny_copy, lambda t: t.pop(Q))
    with pytest.raises(MissingWeightsError, match=rf"^{re.escape(tiny_copy)}: missing 1 weight\(s\): {re.escape(Q)}$") as ei:
        load(tiny_copy)
    assert ei.value.names == [Q]


def test_unexpected_weight_names_the_file(tiny_copy):
    f = _rewrite(tiny_copy, lambda t: t.__setitem__("model.layers.0.self_attn.rogue.weight", np.zeros(3, np.float32)))
    with pytest.raises(UnexpectedWeightError, match=rf"^{re.escape(f)}: unexpected weight 'model.layers.0.self_attn.rogue.weight'"):
        load(tiny_copy)


def test_shape_mismatch_names_the_shard(tiny_llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    out = str(tmp_path / "sharded")
    hf.save_pretrained(out, safe_serialization=True, max_shard_size="40KB")
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        shard = os.path.join(out, json.load(f)["weight_map"][Q])
    tensors = load_file(shard)
    tensors[Q] = tensors[Q][:, :-1].copy()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(WeightShapeError, match=rf"^{re.escape(shard)}: weight '{re.escape(Q)}' has shape \(64, 63\), the model expects \(64, 64\)"):
        load(out)


def test_truncated_file(tiny_copy):
    f = os.path.join(tiny_copy, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(f)}: corrupt or truncated checkpoint: the file's \d+ bytes do not match what its header describes \(truncated\?\)$"):
        load(tiny_copy)


def test_truncated_inside_header(tiny_copy):
    f = os.path.join(tiny_copy, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(50)
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(f)}: corrupt or truncated checkpoint: unreadable header \(invalid header length\)$"):
        load(tiny_copy)


def test_corrupt_header(tiny_copy):
    f = os.path.join(tiny_copy, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.seek(9)
        fh.write(b"\x00garbage\xff")
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(f)}: corrupt or truncated checkpoint: unreadable header"):
        load(tiny_copy)


def test_unknown_dtype(tiny_copy):
    f = os.path.join(tiny_copy, "model.safetensors")
    os.remove(f)
    header = json.dumps({Q: {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}).encode()
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(UnsupportedDtypeError, match=rf"^{re.escape(f)}: weight '{re.escape(Q)}' has unsupported dtype C64$"):
        load(tiny_copy)


def test_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NoWeightsError, match=rf"^{re.escape(str(tmp_path))}: no \*\.safetensors, \*\.gguf or orbax checkpoint found"):
        load(str(tmp_path))


def test_missing_path(tmp_path):
    with pytest.raises(NoWeightsError, match="no such file or directory"):
        load(str(tmp_path / "nope"))


def test_unsupported_architecture(tiny_copy):
    cfg_path = os.path.join(tiny_copy, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FancyNewForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnsupportedModelError, match=r"FancyNewForCausalLM.*not supported by jaxlm"):
        load(tiny_copy)


def test_unknown_load_format(tiny_llama_dir):
    # LoadConfig validates its own field; the loader rejects formats it does not know too.
    with pytest.raises(ValueError, match=r"Unknown load format 'pickle'"):
        LoadConfig(load_format="pickle")
    lc = LoadConfig()
    mc = resolve_model_config(ModelConfig(model=tiny_llama_dir), lc)
    lc.load_format = "pickle"
    with pytest.raises(UnsupportedModelError, match=rf"^{re.escape(tiny_llama_dir)}: unknown load format 'pickle'"):
        get_model(mc, lc, attn_backend=None)


def test_explicit_format_mismatch(tiny_llama_dir):
    with pytest.raises(NoWeightsError, match=r"no \*\.gguf file found"):
        load(tiny_llama_dir, load_format="gguf")


def test_errors_are_value_errors():
    assert issubclass(WeightLoadError, ValueError)
    e = WeightShapeError("<checkpoint>", "w", (1,), (2,)).with_source("/x/model.safetensors")
    assert str(e) == "/x/model.safetensors: weight 'w' has shape (2,), the model expects (1,)"
    assert e.expected == (1,) and e.got == (2,)


def test_float8_tensor_is_read_from_its_bytes(tmp_path):
    """fp8 checkpoints' weights (issue 37): safetensors' numpy reader has no float8 type, so the
    loader reads them from the file's bytes; once refused, now listed and read exactly."""
    import ml_dtypes

    from jaxlm.model_loader.safetensors_utils import tensor_names

    f = str(tmp_path / "f8.safetensors")
    w8 = np.array([0.5, -2.0, 448.0, 0.0], ml_dtypes.float8_e4m3fn)
    save_file({"ok": np.ones(2, np.float32), "w8": w8}, f)
    assert set(tensor_names(f)) >= {"ok", "w8"}
