"""InputProcessor: prompt (text / token ids) + SamplingParams -> a validated, tokenized request."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Union

from jaxlm.sampling_params import SamplingParams

# vLLM's prompt forms: "text", [token ids], {"prompt": text} or {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict]


@dataclasses.dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, eos_token_ids: set[int],
                 check_params: Callable[[SamplingParams], None]):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # eos of the tokenizer and generation_config: all end a request unless ignore_eos.
        self.eos_token_ids = eos_token_ids
        # The sampler's own admission check: whatever it cannot honour is refused here.
        self.check_params = check_params

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"A prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the number "
                "of text tokens plus one generated token."
            )
        return ProcessedPrompt(text, ids)

    def process_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """A copy of params with the engine's defaults and token-level fields filled in."""
        params = params.clone()
        room = self.max_model_len - prompt_len
        # Past max_model_len a request finishes with "length", as in vLLM's offline API.
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params.update_from_generation_config(
            {"eos_token_id": sorted(self.eos_token_ids)}, self.tokenizer.eos_token_id)
        params.all_stop_token_ids |= set(params.stop_token_ids)
        if params.ignore_eos:
            params.all_stop_token_ids.discard(self.tokenizer.eos_token_id)
        params.update_from_tokenizer(self.tokenizer)
        self.check_params(params)
        return params
