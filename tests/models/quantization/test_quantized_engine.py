"""A quantized checkpoint through the offline API keeps the engine's properties: greedy tokens
of transformers on its dequantized weights (logprobs within 1e-4), LoRA on the quantized base
(as transformers + peft on the dequantized one), chunked prefill, prefix caching, no compile
after warm-up; its weights stay in their bytes (start-up log, /metrics' gauge).

One engine for the module: compressed-tensors W4A16 (group 128) of a tiny Llama of hidden 128,
LoRA with one slot of rank 8, a 32-token step budget (the 45-token prompts are chunked).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flax import nnx

from jaxlm import LLM, LoRARequest, SamplingParams
from tests.helpers import quant_checkpoints as qc
from tests.helpers.lora_adapters import PeftReference, make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama

TOL = 1e-4
N_OUT = 8
GREEDY = SamplingParams(max_tokens=N_OUT, temperature=0.0, logprobs=1, ignore_eos=True)


def _prompt(i: int, n: int) -> list[int]:
    return [1] + [3 + (11 * i + 5 * j) % 250 for j in range(n)]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_engine")
    base = make_tiny_llama(root / "float", hidden_size=128, intermediate_size=256)
    qdir, ref_dir = qc.write_quantized(base, "ct-w4a16", str(root / "w4a16"), str(root / "ref"))
    adapter = make_peft_adapter(ref_dir, str(root / "adapter"), seed=3, r=8, lora_alpha=16,
                                target_modules=["q_proj", "v_proj", "down_proj"])
    lines = _Lines()
    logger = logging.getLogger("jaxlm")
    logger.addHandler(lines)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        llm = LLM(model=qdir, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_seqs=4, max_model_len=128,
                  max_num_batched_tokens=32, token_buckets=[16, 32], seq_buckets=[4], num_gpu_blocks_override=24)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
    return llm, PeftReference(ref_dir), adapter, lines.lines, base


def _check(out, ref, adapter, prompt):
    tokens, lps = ref.greedy(adapter, prompt, N_OUT)
    got = list(out.outputs[0].token_ids)
    assert got == tokens, adapter
    got_lps = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(got)]
    assert max(abs(a - b) for a, b in zip(got_lps, lps)) < TOL, adapter


def test_greedy_with_and_without_lora_matches_the_dequantized_model(setup):
    llm, ref, adapter, _, _ = setup
    lora = LoRARequest("a", 1, adapter)
    prompts = [_prompt(0, 45), _prompt(1, 9), _prompt(2, 40)]
    names = [None, lora, lora]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=names, use_tqdm=False)
    for out, req, prompt in zip(outs, names, prompts):
        _check(out, ref, adapter if req else None, prompt)
    # The adapter changes the continuation: LoRA is applied on top of the quantized base.
    assert ref.greedy(adapter, prompts[2], N_OUT)[0] != ref.greedy(None, prompts[2], N_OUT)[0]


def test_prefix_cache_hits_give_the_same_tokens(setup):
    llm, ref, _, _, _ = setup
    prompt = _prompt(5, 47)
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    second = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits >= 32  # two 16-token blocks reused
    assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids)
    _check(second, ref, None, prompt)


def test_weights_stay_packed_and_are_reported(setup):
    llm, _, _, lines, _ = setup
    runner = llm.llm_engine.get_model_runner()
    model = nnx.merge(runner.graphdef, runner.params)
    params = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    held = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in params)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert str(q_proj.qweight.get_value().dtype) == "int32" and q_proj.qweight.get_value().shape == (16, 128)
    config = llm.llm_engine.engine_config.model_config
    assert config.quantization == "compressed-tensors"
    assert config.weight_bytes == held
    # Float32 linears would take 4 bytes a weight; packed 4-bit ones take 0.5 (+ scales).
    linears = 2 * (128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 256)
    assert held < 4 * (2 * 320 * 128) + 0.6 * linears + 4 * 128 * 5
    assert any("quantization: compressed-tensors (w4a16, group 128)" in line and "model weights" in line
               for line in lines), lines
    metrics = {m.name: m for m in llm.get_metrics()}
    gauge = metrics["vllm:model_weight_bytes"]
    assert gauge.value == held and gauge.labels["quantization"] == "compressed-tensors"


def test_no_compiles_after_warm_up(setup):
    llm = setup[0]
    assert llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0


def test_online_fp8_through_llm(setup, tmp_path):
    """LLM(quantization="fp8") quantizes the float checkpoint per output channel at load."""
    base = setup[4]
    ref = PeftReference(qc.fp8_per_channel_reference(base, str(tmp_path / "ref")))
    llm = LLM(model=base, quantization="fp8", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
              token_buckets=[16], seq_buckets=[2])
    prompt = _prompt(7, 20)
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    _check(out, ref, None, prompt)
    assert llm.llm_engine.engine_config.model_config.quantization == "fp8"
    assert llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0


def test_unsupported_quant_method_fails_the_llm_naming_it(setup, tmp_path):
    import json
    import shutil

    path = shutil.copytree(setup[4], tmp_path / "bnb")
    with open(path / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported by jaxlm; supported: awq, "
                                         "compressed-tensors, fp8, gguf, gptq"):
        LLM(model=str(path), max_num_seqs=2, max_model_len=64)
