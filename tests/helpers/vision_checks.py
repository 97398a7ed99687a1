"""An image request's output beside transformers' greedy `generate` on the same processor outputs
(the LLaVA, Gemma 3 and Qwen2.5-VL tests): prompt ids, tokens, and each step's logprobs."""

from __future__ import annotations

from typing import Any

from jaxlm import SamplingParams


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


def hf_greedy(model: Any, inputs: dict, max_tokens: int) -> tuple[list[int], list[int], list]:
    """transformers' prompt ids, greedy tokens and the log-softmax of each step's logits."""
    import torch

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1).numpy() for step in out.logits]
    return inputs["input_ids"][0].tolist(), tokens, logprobs


def max_logprob_diff(out: Any, ref_logprobs: list) -> float:
    """The largest |logprob - transformers'| over every top-k entry of every step."""
    return max(abs(lp.logprob - ref[token_id]) for step, ref in zip(out.outputs[0].logprobs, ref_logprobs)
               for token_id, lp in step.items())


def check_against_hf(out: Any, reference: tuple[list[int], list[int], list], tol: float) -> list[int]:
    """`reference`: hf_greedy's answer for the same prompt and images; returns the tokens."""
    ids, tokens, ref_logprobs = reference
    assert out.prompt_token_ids == ids  # the placeholders expanded as the model's processor does
    assert list(out.outputs[0].token_ids) == tokens
    assert max_logprob_diff(out, ref_logprobs) < tol
    return tokens
