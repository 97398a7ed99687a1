"""The model's generation_config.json on a tiny model: its extra eos ends a request unless
ignore_eos (vLLM's meaning; it used to end it anyway), and its sampling fields become defaults."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from jaxlm import LLM, SamplingParams
from jaxlm.config import ModelConfig
from jaxlm.engine.generation_config import get_diff_sampling_param, try_get_generation_config
from tests.helpers.tiny_models import make_tiny_engine_model

EOS = 2
PROMPT = [5, 17, 42, 9, 100]
NUM_TOKENS = 12


def _hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model whose generation_config.json names a secondary eos that greedy decoding
    emits at position k >= 2 (no eos before it), plus recommended sampling defaults."""
    path = make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))
    greedy = _hf_greedy(path, PROMPT, NUM_TOKENS)
    k = next(i for i, t in enumerate(greedy) if i >= 2 and t != EOS and t not in greedy[:i])
    assert EOS not in greedy[:k], "the tiny model emits eos early; pick another prompt"
    second = greedy[k]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [EOS, second], "pad_token_id": 0,
                   "temperature": 0.0, "top_p": 0.9, "top_k": 5, "do_sample": True}, f)
    llm = LLM(model=path, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
              num_gpu_blocks_override=32, seed=0)
    return llm, greedy, k, second


def test_secondary_eos_stops_without_ignore_eos(model):
    llm, greedy, k, second = model
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NUM_TOKENS), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == greedy[:k + 1]
    assert c.finish_reason == "stop" and c.stop_reason == second


def test_ignore_eos_generates_past_the_secondary_eos(model):
    llm, greedy, k, second = model
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == greedy and second in c.token_ids[:-1]
    assert c.finish_reason == "length"


def test_generation_config_defaults_apply_when_no_params_are_given(model):
    llm, greedy, k, second = model
    assert llm.llm_engine.get_diff_sampling_param() == {"temperature": 0.0, "top_p": 0.9, "top_k": 5}
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.greedy
    # sampling_params=None takes the model's defaults: greedy here, so HF's greedy tokens.
    [out] = llm.generate([PROMPT], use_tqdm=False)
    assert out.outputs[0].token_ids == greedy[:k + 1]


def test_generation_config_modes(tmp_path):
    model_dir, other_dir = tmp_path / "model", tmp_path / "other"
    model_dir.mkdir()
    other_dir.mkdir()
    # top_k 50 and repetition_penalty 1.0 are transformers' defaults: not applied (as vLLM).
    (model_dir / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0, "max_length": 20,
        "eos_token_id": 7}))
    (other_dir / "generation_config.json").write_text(json.dumps({"top_k": 20, "min_p": 0.1}))

    def diff(**kw):
        mc = ModelConfig(model=str(model_dir), **kw)
        return get_diff_sampling_param(mc, try_get_generation_config(mc))

    assert diff() == {"temperature": 0.6, "top_p": 0.9}
    assert diff(generation_config="vllm") == {}
    assert diff(generation_config=str(other_dir)) == {"top_k": 20, "min_p": 0.1}
    assert diff(override_generation_config={"temperature": 0.2, "repetition_penalty": 1.1}) == {
        "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    assert diff(generation_config="vllm", override_generation_config={"top_k": 3}) == {"top_k": 3}
    assert diff(override_generation_config={"top_k": 50}) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50}
    with pytest.raises(ValueError, match="neither 'auto', 'vllm' nor a directory"):
        diff(generation_config=str(tmp_path / "missing"))
    # A model without the file has no defaults.
    assert get_diff_sampling_param(ModelConfig(model=str(other_dir / "x")), {}) == {}
