"""A checkpoint of an architecture jaxlm does not build gets UnsupportedModelError listing the
supported ones, before any other field of its config is read (model_loader/resolve.py). BLIP-2's
config keeps vocab_size, heads and sizes in nested configs (text_config, vision_config,
qformer_config): reading one at the top level was an AttributeError. A tiny random checkpoint
saved by transformers, with a tokenizer, so that only the architecture stands in the way; through
LLM and through the server's start. (LLaVA, refused here before, is served: tests/models/test_llava.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxlm.model_loader.errors import UnsupportedModelError
from tests.helpers.tiny_tokenizer import TINY_VOCAB, add_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def _blip2(path) -> str:
    from transformers import Blip2Config, Blip2ForConditionalGeneration, OPTConfig

    config = Blip2Config(vision_config=dict(**SMALL, image_size=16, patch_size=8),
                         qformer_config=dict(**SMALL, encoder_hidden_size=32, vocab_size=TINY_VOCAB),
                         text_config=OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
                                               vocab_size=TINY_VOCAB, word_embed_proj_dim=32), num_query_tokens=4)
    Blip2ForConditionalGeneration(config).save_pretrained(path, safe_serialization=True)
    return add_tiny_tokenizer(path)


CASES = {"Blip2ForConditionalGeneration": _blip2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("unsupported")
    out = {arch: make(tmp / arch) for arch, make in CASES.items()}
    for arch, path in out.items():  # what the test is about: a nested config without vocab_size on top
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        assert config.architectures == [arch] and not hasattr(config, "vocab_size"), config
    return out


@pytest.mark.parametrize("arch", sorted(CASES))
def test_llm_names_the_architecture_and_the_supported_ones(checkpoints, arch):
    from jaxlm import LLM

    with pytest.raises(UnsupportedModelError) as e:
        LLM(model=checkpoints[arch])
    message = str(e.value)
    assert message.startswith(checkpoints[arch]) and f"['{arch}'] are not supported by jaxlm" in message
    assert "Supported architectures: " in message and "LlamaForCausalLM" in message and "OPTForCausalLM" in message


def test_the_server_start_names_the_architecture(checkpoints):
    arch = "Blip2ForConditionalGeneration"
    proc = subprocess.run([sys.executable, "-m", "jaxlm.serve", checkpoints[arch], "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"['{arch}'] are not supported by jaxlm" in out and "Supported architectures: " in out, out[-3000:]
    assert "AttributeError" not in out, out[-3000:]
