"""SpeculativeConfig: speculative decoding (vLLM's `speculative_config` fields and defaults).

Given as a dict (``LLM(speculative_config={...})``, ``--speculative-config '{...}'``) or as this
dataclass. ``from_dict`` checks every field: an unknown field or method is refused by name, and
vLLM's methods jaxlm lacks (EAGLE, Medusa, ...) get "not supported yet". Light: no jax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# What jaxlm implements, and vLLM's other methods (refused as "not supported yet").
SUPPORTED_METHODS = ("ngram", "draft_model")
VLLM_OTHER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "deepseek_mtp", "mtp", "suffix",
                      "ngram_gpu", "extract_hidden_states", "custom_class")
# vLLM's default n-gram window when neither bound is given.
_DEFAULT_LOOKUP = 5


@dataclasses.dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, the target model verifies them in one step."""

    method: str | None = None
    # Tokens drafted per request per step (a verify step computes 1 + this many per request).
    num_speculative_tokens: int | None = None
    # ngram: the longest suffix of this many tokens (down to prompt_lookup_min) found earlier in
    # the request's tokens proposes the tokens that followed it.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: the draft's path or org/name (in the local HF cache), and its revision.
    model: str | None = None
    revision: str | None = None
    # 1 or the target's tensor_parallel_size (None: the target's).
    draft_tensor_parallel_size: int | None = None
    # No speculation in a step while this many requests (or more) are running.
    disable_by_batch_size: int | None = None
    # Filled by the engine for draft_model: the draft's resolved ModelConfig.
    draft_model_config: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self.method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if self.method in ("[ngram]",):
            self.method = "ngram"
        if self.method is None:
            raise ValueError("speculative_config needs a method: one of " + ", ".join(SUPPORTED_METHODS))
        if not isinstance(self.method, str):
            raise ValueError(f"speculative_config.method must be a string, got {_show(self.method)}")
        if self.method in VLLM_OTHER_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported yet; jaxlm supports "
                             + ", ".join(SUPPORTED_METHODS))
        if self.method not in SUPPORTED_METHODS:
            raise ValueError(f"Unknown speculative_config.method {_show(self.method)}; choose one of "
                             + ", ".join(SUPPORTED_METHODS))
        self.num_speculative_tokens = _positive_int("num_speculative_tokens", self.num_speculative_tokens,
                                                    required=True)
        for name in ("prompt_lookup_max", "prompt_lookup_min", "draft_tensor_parallel_size",
                     "disable_by_batch_size"):
            setattr(self, name, _positive_int(name, getattr(self, name)))
        for name in ("model", "revision"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"speculative_config.{name} must be a string, got {_show(value)}")
        if self.method == "ngram":
            self._ngram_defaults()
        elif not self.model:
            raise ValueError("speculative_config.model (the draft model's path or name) is required "
                             "for method='draft_model'")

    def _ngram_defaults(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = _DEFAULT_LOOKUP
        self.prompt_lookup_min = lo if lo is not None else hi
        self.prompt_lookup_max = hi if hi is not None else lo
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def from_dict(cls, value: "dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """The config from a dict (None and an empty dict: no speculation); unknown keys are
        refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (dict), got {type(value).__name__}")
        if not value:
            return None
        known = {f.name for f in dataclasses.fields(cls) if f.name != "draft_model_config"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"Unknown speculative_config field(s): {', '.join(map(_show, unknown[:5]))}; "
                             f"jaxlm's are {', '.join(sorted(known))}")
        return cls(**value)

    def check_against(self, max_num_batched_tokens: int, max_model_len: int, tensor_parallel_size: int) -> None:
        """Limits that depend on the engine: one verify step of one request must fit the budget."""
        k = self.num_speculative_tokens
        if k >= min(max_num_batched_tokens, max_model_len):
            raise ValueError(f"speculative_config.num_speculative_tokens={k} must be below "
                             f"max_num_batched_tokens={max_num_batched_tokens} and max_model_len={max_model_len}")
        tp = self.draft_tensor_parallel_size
        if self.method == "draft_model" and tp is not None and tp not in (1, tensor_parallel_size):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp} must be 1 or the target's "
                             f"tensor_parallel_size={tensor_parallel_size}")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"


def max_sampled_rows(spec: SpeculativeConfig | None, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Rows a step's sampler may hold: one per request, or 1 + k per speculating request (each
    row is a scheduled token, so never more than the budget)."""
    if spec is None:
        return max_num_seqs
    return max(max_num_seqs, min(max_num_seqs * (1 + spec.num_speculative_tokens), max_num_batched_tokens))


def _positive_int(name: str, value: Any, required: bool = False) -> int | None:
    if value is None:
        if required:
            raise ValueError(f"speculative_config.{name} is required (a positive integer)")
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    """A value for an error message, cut short (a field may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
