"""Quantized MoE checkpoints through ``jaxlm.LLM`` beside transformers on the dequantized weights
(tests/models/quantization/test_moe_*.py and quant_moe_mesh_cases.py share this).

The model: the tiny Qwen2-MoE of tiny_models (hidden 64, 7 experts of 32, top-2, a shared
expert of 48, a dense layer between sparse ones), each of its Linears and experts quantized by
quant_checkpoints with groups of 16 (which divide 64, 48 and 32). The reference: transformers
in float32 on the dequantized weights, greedy with full recompute, each step's top-k logprobs.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from flax import nnx

from tests.helpers import quant_checkpoints as qc
from tests.helpers import tiny_models as tm

GROUP = 16
N_OUT = 6
TOP_K = 4
# Prompt lengths 21 and 5 under a 16-token budget: the first is prefilled in two chunks.
PROMPTS = [[1] + [3 + (13 * i + 7 * j) % 250 for j in range(n)] for i, n in enumerate((20, 4))]
ENGINE = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, token_buckets=[16], seq_buckets=[2])


def float_model(root: str, family: str = "qwen2_moe", name: str | None = None, **overrides) -> str:
    return tm.make_tiny_model(family, os.path.join(root, name or family), **overrides)


def quantized(base: str, fmt: str, root: str) -> tuple[str, str]:
    """(quantized checkpoint, float checkpoint of its dequantized weights)."""
    name = os.path.basename(base)
    return qc.write_quantized(base, fmt, os.path.join(root, f"{name}-{fmt}"), os.path.join(root, f"{name}-{fmt}-ref"),
                              group=GROUP)


def hf_greedy(path: str, prompts: list[list[int]] = PROMPTS, n: int = N_OUT) -> list[dict]:
    """Per prompt: transformers' greedy tokens and each step's top-k logprobs {token: logprob}."""
    model = tm.load_hf_model(path)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, tokens, steps = list(prompt), [], []
            for _ in range(n):
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
                top = torch.topk(lp, TOP_K)
                steps.append({int(t): float(v) for t, v in zip(top.indices, top.values)})
                tokens.append(int(top.indices[0]))
                ids.append(tokens[-1])
            out.append(dict(tokens=tokens, logprobs=steps))
    return out


def run_llm(path: str, quantization: str | None = None, **engine) -> tuple[list[dict], dict]:
    """Greedy outputs of ``LLM(path)`` as hf_greedy gives them, and facts about its weights:
    the reported weight bytes, the bytes and dtypes of the experts' Params (device 0's shards)."""
    import jax

    from jaxlm import LLM, SamplingParams

    llm = LLM(model=path, quantization=quantization, **{**ENGINE, **engine})
    params = SamplingParams(max_tokens=N_OUT, temperature=0.0, logprobs=TOP_K, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = [dict(tokens=list(o.outputs[0].token_ids),
                logprobs=[{int(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
           for o in outs]
    runner = llm.llm_engine.get_model_runner()
    dev = jax.devices()[0]
    experts = {}
    for path_, v in nnx.to_flat_state(runner.params):
        if "experts" in path_:  # the stacked experts (not the shared expert's Linears)
            value = v.get_value()
            shard = [s.data for s in value.addressable_shards if s.device == dev][0]
            experts[".".join(map(str, path_))] = dict(dtype=str(value.dtype), shape=list(value.shape),
                                                      shard=list(shard.shape), bytes=int(value.nbytes))
    held = sum(int(v.get_value().nbytes) for _, v in nnx.to_flat_state(runner.params))
    facts = dict(weight_bytes=llm.llm_engine.engine_config.model_config.weight_bytes, held=held, experts=experts,
                 compiles=runner.num_compiles_after_warmup)
    del llm
    return got, facts


def max_logprob_diff(got: list[dict], ref: list[dict], common_only: bool = False) -> float:
    """Largest |difference| over every step's reference top-k logprobs (a token missing from
    ours counts as infinitely far). ``common_only``: over the tokens both top-k hold, up to the
    first step whose greedy tokens differ (a model that is only close may rank a near tie
    otherwise)."""
    worst = 0.0
    for g, r in zip(got, ref):
        for gt, rt, gs, rs in zip(g["tokens"], r["tokens"], g["logprobs"], r["logprobs"]):
            for t, v in rs.items():
                if t in gs:
                    worst = max(worst, abs(gs[t] - v))
                elif not common_only:
                    return float("inf")
            if common_only and gt != rt:
                break
    return worst
