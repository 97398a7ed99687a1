"""SamplingParams with vLLM's fields, defaults and validation."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from jaxlm.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds all text so far
    DELTA = 1  # every output holds only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # One output constraint (JSON schema, regex, choice, grammar), vLLM's name; a dict is read
    # as StructuredOutputsParams' fields.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the input processor: eos + generation-config stop ids, tokenized bad words.
    all_stop_token_ids: set[int] = dataclasses.field(default_factory=set, repr=False)
    bad_words_token_ids: list[list[int]] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._verify()
        if self.greedy:
            # Zero temperature is greedy: the random-sampling filters do not apply (as vLLM).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        # The InputProcessor adds eos / generation-config ids (update_from_generation_config).
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(field: str, why: str, value: Any) -> ValueError:
            return ValueError(f"{field} {why}, got {value!r}")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                     "top_p", "min_p"):
            value = getattr(self, name)
            # NaN passes every comparison below and inf temperature divides logits to NaN.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number", value)
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2]", value)
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be > 0", self.repetition_penalty)
        if self.temperature < 0.0:
            raise bad("temperature", "must be >= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1 (disable), 0 (disable) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]", self.min_p)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "must be an integer >= 0", value)
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer", self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings", self.stop)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be StructuredOutputsParams or a dict of its fields",
                      self.structured_outputs)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "must not be empty", self.allowed_token_ids)
        if self.stop and not self.detokenize:
            raise bad("stop", "strings are only supported when detokenize is True", self.stop)

    def update_from_generation_config(self, generation_config: dict[str, Any],
                                      model_eos_token_id: int | None = None) -> None:
        """Add eos and generation_config.eos_token_id(s) to the stop ids (vLLM's rule); the
        InputProcessor calls it, the one place a request's stop ids are resolved.

        all_stop_token_ids (min_tokens masking) gets all of them; stop_token_ids (which finish
        a request) gets the extra generation-config ids unless ignore_eos.
        """
        if model_eos_token_id is not None:
            self.all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        eos_ids.discard(model_eos_token_id)
        if eos_ids:
            self.all_stop_token_ids.update(eos_ids)
            if not self.ignore_eos:
                self.stop_token_ids = sorted(eos_ids | set(self.stop_token_ids))

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize bad_words into bad_words_token_ids, with and without a leading space.

        The spaced form is added only when it is a different word of the same length, so a word
        is banned both at the start of the text and after a space (vLLM's rule).
        """
        if not self.bad_words:
            return
        words: list[list[int]] = []
        for bad_word in self.bad_words:
            plain = tokenizer.encode(bad_word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + bad_word.lstrip(), add_special_tokens=False)
            if plain:
                words.append(plain)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                words.append(spaced)
        self.bad_words_token_ids = words

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> "SamplingParams":
        return dataclasses.replace(self)


@dataclasses.dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters (vLLM's): beam_width beams, each step extended by their
    2 × beam_width most likely tokens; ranked by cumulative logprob / length ** length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
