"""PEFT adapters checked against a model: every way an adapter can be unusable is an error that
names it; scales (alpha/r, rsLoRA, per-module patterns); fused modules; the local HF cache."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxlm.config import LoadConfig, LoRAConfig, ModelConfig
from jaxlm.lora import LoRAAdapterError, LoRARequest
from jaxlm.lora.checker import LoRAChecker
from jaxlm.lora.module_path import LoRAModulePath, parse_lora_module
from jaxlm.lora.peft import check_adapter, load_adapter
from jaxlm.model_loader import resolve_model_config
from tests.helpers.lora_adapters import edit_adapter_config, make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama, make_tiny_model

MAX_RANK = 8


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    base = make_tiny_llama(root / "llama")
    good = make_peft_adapter(base, str(root / "good"), seed=1, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj", "down_proj"], alpha_pattern={"down_proj": 2})
    mc = resolve_model_config(ModelConfig(model=base), LoadConfig())
    checker = LoRAChecker(mc, LoRAConfig(enable_lora=True, max_lora_rank=MAX_RANK))
    return root, base, good, checker


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_good_adapter_scales_and_layout(env):
    root, base, good, checker = env
    spec = checker.check(LoRARequest("good", 1, good))
    q = spec.modules["model.layers.0.self_attn.q_proj"]
    down = spec.modules["model.layers.1.mlp.down_proj"]
    assert (q.rank, q.scale, down.scale) == (4, 8 / 4, 2 / 4)  # alpha / r, alpha_pattern per module
    weights = load_adapter(spec, np.float32)
    a, b = weights["model.layers.0.self_attn.q_proj"]
    raw = load_file(os.path.join(good, "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    np.testing.assert_array_equal(a, raw[f"{key}.lora_A.weight"].T)  # [in, r]
    np.testing.assert_allclose(b, raw[f"{key}.lora_B.weight"].T * 2.0)  # [r, out], scale folded in
    rs = _copy(good, root / "rslora")
    edit_adapter_config(rs, use_rslora=True)
    assert check_adapter("rs", rs, checker.targets, MAX_RANK).modules[key[len("base_model.model."):]].scale \
        == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize("case,match", [
    ("no_config", "no adapter_config.json in"),
    ("no_weights", "no adapter_model.safetensors in"),
    ("rank", "LoRA rank 16 of model.layers.0.self_attn.q_proj is greater than max_lora_rank 8"),
    ("target", "target module 'wq' is not a layer of this model \\(LlamaForCausalLM\\); adaptable modules: "
               "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    ("shape", "do not fit the layer's 64 inputs and 64 outputs: the adapter was trained for a base model of "
              "another shape"),
    ("dora", "DoRA adapters \\(use_dora\\) are not supported"),
    ("loha", "PEFT type 'LOHA' is not supported \\(only LORA adapters\\)"),
    ("embedding", "is not a LoRA A/B matrix"),
    ("unpaired", "has no lora_B.weight"),
    ("bad_json", "adapter_config.json is not valid JSON"),
    ("missing_dir", "is neither a local directory nor in the local Hugging Face cache"),
    ("nan", "holds NaN or infinite values"),
])
def test_bad_adapters_name_the_problem(env, tmp_path, case, match):
    root, base, good, checker = env
    path = _copy(good, tmp_path / case)
    weights = os.path.join(path, "adapter_model.safetensors")
    if case == "no_config":
        os.remove(os.path.join(path, "adapter_config.json"))
    elif case == "no_weights":
        os.remove(weights)
    elif case == "rank":
        path = make_peft_adapter(base, str(tmp_path / "r16"), seed=2, r=16, target_modules=["q_proj"])
    elif case == "target":
        edit_adapter_config(path, target_modules=["q_proj", "wq"])
    elif case == "shape":
        other = make_tiny_llama(tmp_path / "narrow", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                num_key_value_heads=1)
        path = make_peft_adapter(other, str(tmp_path / "narrow_adapter"), seed=3, r=4, target_modules=["q_proj"])
    elif case == "dora":
        edit_adapter_config(path, use_dora=True)
    elif case == "loha":
        edit_adapter_config(path, peft_type="LOHA")
    elif case in ("embedding", "unpaired", "nan"):
        tensors = load_file(weights)
        if case == "embedding":
            tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((4, 320), np.float32)
        elif case == "unpaired":
            del tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
        else:
            tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"][0, 0] = np.nan
        save_file(tensors, weights)
    elif case == "bad_json":
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write("{not json")
    elif case == "missing_dir":
        path = "nobody/no-such-adapter"
    with pytest.raises(LoRAAdapterError, match=match) as info:
        spec = check_adapter(case, path, checker.targets, MAX_RANK)
        load_adapter(spec, np.float32)
    assert info.value.adapter == case


def test_adapter_by_name_from_the_local_hf_cache(env, tmp_path, monkeypatch):
    _, _, good, checker = env
    snapshot = tmp_path / "hub" / "models--acme--tiny-lora" / "snapshots" / ("0" * 40)
    _copy(good, snapshot)
    (tmp_path / "hub" / "models--acme--tiny-lora" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-lora" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = check_adapter("acme", "acme/tiny-lora", checker.targets, MAX_RANK)
    assert spec.path == str(snapshot) and len(spec.modules) == 6


def test_checker_refuses_without_enable_lora(env):
    _, _, good, checker = env
    off = LoRAChecker(checker.model_config, LoRAConfig())
    with pytest.raises(ValueError, match="LoRA adapters are not enabled: start the engine with enable_lora=True"):
        off.check(LoRARequest("good", 1, good))
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest, got str"):
        checker.check("good")


@pytest.mark.parametrize("family,fused,parts", [
    ("gpt2", "transformer.h.0.attn.c_attn", ("q_proj", "k_proj", "v_proj")),  # Conv1D, [in, out] already
    ("phi3", "model.layers.1.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("phi3", "model.layers.0.mlp.gate_up_proj", ("gate_proj", "up_proj")),
])
def test_fused_module_is_split_over_its_parts(tmp_path, family, fused, parts):
    # A fused HF module holds several of our linears: its adapter's B is split over their outputs.
    base = make_tiny_model(family, tmp_path / family)
    name = fused.rsplit(".", 1)[1]
    path = make_peft_adapter(base, str(tmp_path / "lora"), seed=4, r=4, target_modules=[name])
    checker = LoRAChecker(resolve_model_config(ModelConfig(model=base), LoadConfig()),
                          LoRAConfig(enable_lora=True, max_lora_rank=8))
    spec = checker.check(LoRARequest("f", 1, path))
    weights = load_adapter(spec, np.float32)
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    a_raw, b_raw = (raw[f"base_model.model.{fused}.lora_{x}.weight"] for x in "AB")
    start, parent = 0, fused.rsplit(".", 1)[0]
    for part in parts:
        a, b = weights[f"{parent}.{part}"]
        np.testing.assert_array_equal(a, a_raw.T)
        width = checker.targets.modules[f"{parent}.{part}"].out_features
        np.testing.assert_allclose(b, b_raw.T[:, start:start + width] * spec.modules[fused].scale)
        start += width
    assert start == b_raw.shape[0]


@pytest.mark.parametrize("text,expected", [
    ("sql=/adapters/sql", LoRAModulePath("sql", "/adapters/sql")),
    ('{"name": "sql", "path": "acme/sql-lora", "base_model_name": "base"}',
     LoRAModulePath("sql", "acme/sql-lora", "base")),
])
def test_lora_modules_forms(text, expected):
    assert parse_lora_module(text) == expected


@pytest.mark.parametrize("text,match", [
    ("sql", "expected name=path"), ("=/x", "must not be empty"), ('{"name": "x"}', 'needs string "name" and "path"'),
    ('{"name": "x", "path": "/p", "rank": 4}', "unknown key"), ("{bad", "not valid JSON"),
])
def test_lora_modules_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_lora_module(text)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lora_name="x", lora_int_id=0), "lora_int_id must be an integer in \\[1, 2\\*\\*63\\)"),
    (dict(lora_name="x", lora_int_id=True), "lora_int_id must be an integer"),
    (dict(lora_name="x", lora_int_id=2**64), "lora_int_id must be an integer"),
    (dict(lora_name="x", lora_int_id=1.5), "lora_int_id must be an integer"),
    (dict(lora_name="", lora_int_id=1), "lora_name must be a non-empty string"),
    (dict(lora_name="x", lora_int_id=1, lora_path=3), "lora_path must be a string"),
])
def test_lora_request_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(**kwargs)


def test_lora_config_limits():
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3
    for kwargs, match in [(dict(max_loras=0), "max_loras must be an integer >= 1"),
                          (dict(max_lora_rank=10**9), "max_loras x max_lora_rank = 1000000000 is more than"),
                          (dict(max_loras=-3), "max_loras must be an integer >= 1"),
                          (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras \\(2\\) must be >= max_loras \\(4\\)")]:
        with pytest.raises(ValueError, match=match):
            LoRAConfig(**kwargs)
    json.dumps(LoRAConfig().__dict__)  # plain values: it travels to engine-core processes
