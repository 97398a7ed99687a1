"""Which runner serves a model and which pooler it gets: the flags, the architecture,
sentence-transformers' modules.json and 1_Pooling/config.json (no jax, no weights)."""

from __future__ import annotations

import json
import types

import pytest

from jaxlm.config.pooling import PoolingConfig
from jaxlm.pooling.resolve import (
    is_pooling_architecture, pooling_architecture, read_sentence_transformers, resolve_pooler_spec,
    use_pooling_runner)


def _cfg(*archs):
    return types.SimpleNamespace(architectures=list(archs))


def test_architecture_rules():
    assert is_pooling_architecture("BertModel") and is_pooling_architecture("Qwen2ForSequenceClassification")
    assert not is_pooling_architecture("LlamaForCausalLM") and not is_pooling_architecture("GPT2LMHeadModel")
    auto = PoolingConfig()
    assert use_pooling_runner(auto, _cfg("BertModel"), None)
    assert not use_pooling_runner(auto, _cfg("LlamaForCausalLM"), None)
    assert use_pooling_runner(PoolingConfig(task="embed"), _cfg("LlamaForCausalLM"), None)
    with pytest.raises(ValueError, match="--runner pooling"):
        use_pooling_runner(PoolingConfig(runner="generate"), _cfg("BertModel"), None)
    assert pooling_architecture(PoolingConfig(convert="embed"), _cfg("Qwen3ForCausalLM")) == "Qwen3Model"
    assert pooling_architecture(PoolingConfig(task="score"), _cfg("Qwen2ForCausalLM")) == \
        "Qwen2ForSequenceClassification"
    assert pooling_architecture(auto, _cfg("XLMRobertaModel")) == "XLMRobertaModel"
    with pytest.raises(ValueError, match="contradicts"):
        PoolingConfig(runner="generate", task="embed")
    with pytest.raises(ValueError, match="unknown key"):
        PoolingConfig(pooler_config={"pooling": "MEAN"})


@pytest.mark.parametrize("pooling_cfg,expected", [
    ({"pooling_mode": "cls"}, "CLS"),
    ({"pooling_mode": "lasttoken"}, "LAST"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "MEAN"),  # the older keys
])
def test_sentence_transformers_checkpoint(tmp_path, pooling_cfg, expected):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_cfg))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    assert read_sentence_transformers(str(tmp_path)) == {"pooling_type": expected, "normalize": True}
    # A sentence-transformers directory of an architecture that would otherwise generate: pooling.
    assert use_pooling_runner(PoolingConfig(), _cfg("MistralForCausalLM"), str(tmp_path))
    spec = resolve_pooler_spec(PoolingConfig(), _cfg("BertModel"), str(tmp_path), default_pooling_type="CLS",
                               hidden_size=8, num_labels=None)
    assert spec.pooling_type == expected and spec.supported_tasks == ("embed", "score", "encode")
    spec = resolve_pooler_spec(PoolingConfig(pooler_config={"pooling_type": "mean", "normalize": False}),
                               _cfg("BertModel"), str(tmp_path), default_pooling_type="CLS", hidden_size=8,
                               num_labels=None)
    assert (spec.pooling_type, spec.normalize) == ("MEAN", False)


def test_unsupported_sentence_transformers_pooling_is_named(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    with pytest.raises(ValueError, match="pooling_mode 'max' is not supported"):
        read_sentence_transformers(str(tmp_path))
