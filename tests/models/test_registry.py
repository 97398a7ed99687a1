"""Architecture registry: built-in families, unsupported architectures, out-of-tree models."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from jaxlm.models.registry import ModelRegistry, get_model_architecture

BUILTIN = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "OPTForCausalLM",
    "GPT2LMHeadModel",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
    "GraniteForCausalLM",
}


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations made by a test do not leak into the others."""
    monkeypatch.setattr(ModelRegistry, "_models", dict(ModelRegistry._models))
    return ModelRegistry


def test_builtin_architectures_resolve_to_their_class() -> None:
    assert BUILTIN <= set(ModelRegistry.get_supported_archs())
    for arch in BUILTIN:
        cls = get_model_architecture(types.SimpleNamespace(architectures=[arch]))
        assert cls.__name__ == arch
        assert cls.__module__.startswith("jaxlm.models.")
        for attr in ("load_weights", "expected_weight_names", "compute_logits", "get_kv_cache_spec"):
            assert callable(getattr(cls, attr)), (arch, attr)


def test_first_supported_architecture_of_the_list_wins() -> None:
    cfg = types.SimpleNamespace(architectures=["NoSuchModel", "Qwen2ForCausalLM"])
    assert get_model_architecture(cfg).__name__ == "Qwen2ForCausalLM"


def test_unsupported_architecture_lists_supported_ones() -> None:
    with pytest.raises(ValueError) as e:
        get_model_architecture(types.SimpleNamespace(architectures=["FalconForCausalLM"]))
    msg = str(e.value)
    assert "FalconForCausalLM" in msg
    for arch in BUILTIN:
        assert arch in msg


def test_missing_architectures_field_is_an_error() -> None:
    with pytest.raises(ValueError, match="Supported architectures"):
        get_model_architecture(types.SimpleNamespace(architectures=None))


def test_out_of_tree_model_by_qualified_name(clean_registry, tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "oot_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "my_model.py").write_text("class MyForCausalLM:\n    marker = 'oot'\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    clean_registry.register_model("MyForCausalLM", "oot_pkg.my_model:MyForCausalLM")
    assert clean_registry.is_supported("MyForCausalLM")
    cls = get_model_architecture(types.SimpleNamespace(architectures=["MyForCausalLM"]))
    assert cls.marker == "oot"
    assert "MyForCausalLM" in clean_registry.get_supported_archs()


def test_out_of_tree_model_can_override_a_builtin(clean_registry) -> None:
    class Custom:
        pass

    clean_registry.register_model("LlamaForCausalLM", Custom)
    assert get_model_architecture(types.SimpleNamespace(architectures=["LlamaForCausalLM"])) is Custom


def test_bad_qualified_names_are_rejected(clean_registry) -> None:
    with pytest.raises(ValueError, match="package.module:ClassName"):
        clean_registry.register_model("X", "oot_pkg.my_model.MyForCausalLM")
    clean_registry.register_model("Y", "no_such_pkg_jaxlm.mod:Cls")
    with pytest.raises(ModuleNotFoundError):
        get_model_architecture(types.SimpleNamespace(architectures=["Y"]))


def test_registry_imports_lazily() -> None:
    # Importing the registry must not import the families (jax tracing code, big modules).
    code = (
        "import sys, jaxlm.models.registry as r; "
        "assert not any(m in sys.modules for m in ('jaxlm.models.llama', 'jaxlm.models.opt', 'jaxlm.models.gpt2'));"
        "r.get_model_architecture(type('C', (), {'architectures': ['OPTForCausalLM']})); "
        "assert 'jaxlm.models.opt' in sys.modules and 'jaxlm.models.gpt2' not in sys.modules"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
