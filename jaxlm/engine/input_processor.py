"""InputProcessor: the one admission path. A request's prompt (text / token ids / dict), id and
SamplingParams are validated and resolved here, and nowhere else; what passes cannot fail later
in a step. Every refusal is a ValueError naming the field: an InvalidRequestError (which also
carries it as `param`), SamplingParams' own check, or the sampler's (check_params)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Union

from jaxlm.sampling_params import SamplingParams

# vLLM's prompt forms: "text", [token ids], {"prompt": text} or {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict]

# Caps no real client meets (OpenAI allows 4 stop strings). Each bounds per-request CPU work:
# stop strings are searched in the new text at every step, bad words are matched every step and
# fan out into the sampler's fixed-width bias row.
MAX_STOP_STRINGS = 256
MAX_STOP_STRINGS_TOTAL_CHARS = 16_384
MAX_STOP_TOKEN_IDS = 1_024
MAX_BAD_WORDS = 256
# One request's n fans out into n sequences; past this it is a denial of service, not a use.
MAX_N = 1_024
# Seeds are masked into the sampler's uint64 stream ids: int64 or uint64 values are accepted.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1
# Priorities travel to the engine cores as msgpack integers (int64).
_PRIORITY_MIN, _PRIORITY_MAX = -(1 << 63), (1 << 63) - 1
# The sampler's float arrays are float32: a larger finite value would become inf there.
_F32_MAX = 3.4028234663852886e38


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the field (the server's 400 `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room to generate; the server words it the OpenAI way."""

    def __init__(self, prompt_len: int, max_model_len: int) -> None:
        super().__init__(
            "prompt",
            f"The decoder prompt (length {prompt_len}) is longer than the maximum model length of "
            f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number of text "
            "tokens plus one generated token.")
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len


@dataclasses.dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    # Its images (jaxlm.multimodal.inputs.MultiModalFeatureSpec), placeholders expanded in the ids.
    mm_features: list[Any] | None = None


def make_internal_request_id(request_id: str, serial: int) -> str:
    """The engine's key for a request: the client's id plus a suffix (as vLLM), so two live
    requests with one client id, or an id reused after an abort, never share state. The suffix
    is the caller's serial number rather than vLLM's random one: unique by construction (the
    last '-' splits an internal id back into its parts, and a serial never repeats), and it
    keeps unseeded sampling reproducible for one engine seed (the random stream hashes the id)."""
    return f"{request_id}-{serial}"


def check_utf8(param: str, text: str) -> None:
    """Lone surrogates ("\\ud800" is legal JSON) cannot be encoded, tokenized or hashed."""
    if not isinstance(text, str):
        raise InvalidRequestError(param, f"{param} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(param, f"{param} is not valid UTF-8: {e.reason} at position {e.start}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class InputProcessor:
    """vocab_size: the logits' width; eos_token_id: the tokenizer's (ends a request unless
    ignore_eos); generation_eos_ids: every eos id of generation_config.json and the model config
    (the others end a request unless ignore_eos, as stop_token_ids); check_params: the
    sampler's own admission check (what it cannot honour, e.g. logprobs above max_logprobs);
    structured_output_manager: returns the engine's StructuredOutputManager (built on first
    use), which compiles a request's constraint here, so a bad one fails only that request;
    scheduling_policy: the engine's (a non-zero priority needs "priority")."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, eos_token_id: int | None,
                 generation_eos_ids: set[int], check_params: Callable[[SamplingParams], None],
                 structured_output_manager: Callable[[], Any] | None = None, *,
                 scheduling_policy: str = "fcfs", mm_processor: Any = None, model_name: str = "this model"):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.generation_eos_ids = frozenset(generation_eos_ids)
        self.check_params = check_params
        self.structured_output_manager = structured_output_manager
        self.scheduling_policy = scheduling_policy
        # A multimodal model's image preprocessing (multimodal/processing.py); None: text only.
        self.mm_processor = mm_processor
        self.model_name = model_name

    def check_request_id(self, request_id: str) -> None:
        check_utf8("request_id", request_id)

    def check_priority(self, priority: Any) -> None:
        """An int64; other than 0 only under the priority policy (vLLM refuses it too)."""
        if not _is_int(priority):
            raise InvalidRequestError("priority", f"priority must be an integer, got {type(priority).__name__}")
        if not _PRIORITY_MIN <= priority <= _PRIORITY_MAX:
            raise InvalidRequestError("priority", f"priority must fit in 64 bits, got {priority}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(
                "priority", f"priority={priority} needs --scheduling-policy priority "
                            f"(LLM(scheduling_policy='priority')); this engine schedules {self.scheduling_policy}")

    def process_prompt(self, prompt: PromptType | ProcessedPrompt) -> ProcessedPrompt:
        if isinstance(prompt, ProcessedPrompt):
            return prompt  # made by process_prompt already (the server checks before queueing)
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") is not None:
                return self._process_multimodal(prompt)
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("prompt", "A prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        if isinstance(prompt, str):
            check_utf8("prompt", prompt)
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", f"{_NO_TOKENIZER}: prompts must be token ids "
                                                    "({'prompt_token_ids': [...]} or a list of ints)")
            text, ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise InvalidRequestError(
                "prompt", f"A prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        self.check_prompt_token_ids(ids)
        self.check_prompt_len(len(ids))
        return ProcessedPrompt(text, ids)

    def _process_multimodal(self, prompt: dict) -> ProcessedPrompt:
        """{"prompt": text, "multi_modal_data": {"image": PIL image or list}}: the model's processor
        expands the placeholders and preprocesses the images (multimodal/processing.py)."""
        data = prompt["multi_modal_data"]
        if self.mm_processor is None:
            raise InvalidRequestError("multi_modal_data", f"{self.model_name} does not support multimodal inputs "
                                                          "(multi_modal_data): it is a text-only model")
        if not isinstance(data, dict) or set(data) != {"image"}:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise InvalidRequestError("multi_modal_data", f"multi_modal_data must be a dict with the key 'image' "
                                                          f"(the only modality supported), got {keys}")
        return self.process_multimodal(prompt.get("prompt"), data["image"])

    def process_multimodal(self, text: Any, images: Any, add_special_tokens: bool = True) -> ProcessedPrompt:
        """A text prompt with its images (LLM.chat's rendered template: add_special_tokens=False)."""
        if self.mm_processor is None:
            raise InvalidRequestError("multi_modal_data", f"{self.model_name} does not support multimodal inputs "
                                                          "(multi_modal_data): it is a text-only model")
        if text is not None:
            check_utf8("prompt", text)
        try:
            ids, features = self.mm_processor.process(text, images, add_special_tokens=add_special_tokens)
        except ValueError as e:
            raise InvalidRequestError(getattr(e, "param", "multi_modal_data"), str(e)) from None
        self.check_prompt_token_ids(ids)
        self.check_prompt_len(len(ids))
        return ProcessedPrompt(text, ids, features)

    def chat_images(self) -> Any:
        """A ChatImages collecting a conversation's image parts, None for a text-only model."""
        if self.mm_processor is None:
            return None
        from jaxlm.multimodal.inputs import ChatImages

        return ChatImages(self.mm_processor.placeholder, self.mm_processor.allowed_local_media_path)

    def check_prompt_token_ids(self, ids: list[int]) -> None:
        """Non-empty and in the vocabulary (also what /detokenize needs)."""
        if not ids:
            raise InvalidRequestError("prompt", "The decoder prompt cannot be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt", f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")

    def check_prompt_len(self, prompt_len: int) -> None:
        """Room for at least one generated token."""
        if prompt_len >= self.max_model_len:
            raise PromptTooLongError(prompt_len, self.max_model_len)

    def max_tokens_for(self, prompt_len: int, requested: int | None) -> int:
        """max_tokens clamped to the room left: past max_model_len a request ends with "length"."""
        room = self.max_model_len - prompt_len
        return room if requested is None else min(requested, room)

    def process_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """A validated copy of params with the engine-dependent fields resolved."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
        params = params.clone()  # re-runs SamplingParams' own checks on the current field values
        self._check_limits(params)
        if self.tokenizer is None:
            _check_without_tokenizer(params)
        params.max_tokens = self.max_tokens_for(prompt_len, params.max_tokens)
        if params.top_k >= self.vocab_size:
            params.top_k = 0  # all tokens, as vLLM clamps top_k to the vocabulary
        # The one place stop ids are resolved: stop_token_ids end the request (the user's and
        # generation_config's extra eos ids unless ignore_eos); all_stop_token_ids are only held
        # back under min_tokens; the tokenizer's eos ends it unless ignore_eos (the scheduler).
        params.update_from_generation_config(
            {"eos_token_id": sorted(self.generation_eos_ids)}, self.eos_token_id)
        params.update_from_tokenizer(self.tokenizer)
        self.check_params(params)
        if params.structured_outputs is not None:
            self._compile_constraint(params)
        return params

    def _compile_constraint(self, params: SamplingParams) -> None:
        """Compile (or find in the cache) the constraint now: the step never sees a bad one."""
        if self.structured_output_manager is None:
            raise InvalidRequestError("structured_outputs", "this engine does not support structured outputs")
        try:
            self.structured_output_manager().compile(params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError("structured_outputs", str(e)) from None

    def _check_limits(self, p: SamplingParams) -> None:
        if p.n > MAX_N:
            raise InvalidRequestError("n", f"n must be <= {MAX_N}, got {p.n}")
        if p.seed is not None and not _SEED_MIN <= p.seed <= _SEED_MAX:
            raise InvalidRequestError("seed", f"seed must fit in 64 bits, got {p.seed}")
        _check_count("stop", "stop strings", len(p.stop), MAX_STOP_STRINGS)
        for s in p.stop:
            check_utf8("stop", s)
        total = sum(len(s) for s in p.stop)
        if total > MAX_STOP_STRINGS_TOTAL_CHARS:
            raise InvalidRequestError("stop", f"stop strings hold {total} characters; at most "
                                              f"{MAX_STOP_STRINGS_TOTAL_CHARS} are supported")
        _check_count("stop_token_ids", "stop_token_ids", len(p.stop_token_ids), MAX_STOP_TOKEN_IDS)
        if p.bad_words is not None:
            _check_count("bad_words", "bad_words", len(p.bad_words), MAX_BAD_WORDS)
            for word in p.bad_words:
                check_utf8("bad_words", word)
        for name in ("temperature", "repetition_penalty"):  # the others are bounded already
            value = getattr(p, name)
            if value > _F32_MAX:
                raise InvalidRequestError(name, f"{name} must be at most {_F32_MAX:.4g}, got {value}")
        for token_id, bias in (p.logit_bias or {}).items():
            if not (math.isfinite(bias) and abs(bias) <= _F32_MAX):
                raise InvalidRequestError(
                    "logit_bias", f"logit_bias values must be finite float32 numbers, got {bias} for {token_id}")


_NO_TOKENIZER = "skip_tokenizer_init is set (no tokenizer is loaded)"


def _check_without_tokenizer(p: SamplingParams) -> None:
    """What needs text refuses to run without a tokenizer (vLLM's skip_tokenizer_init)."""
    for name, value in (("stop", p.stop), ("bad_words", p.bad_words), ("structured_outputs", p.structured_outputs)):
        if value:
            raise InvalidRequestError(name, f"{_NO_TOKENIZER}: {name} needs a tokenizer; use token ids "
                                            "(stop_token_ids, logit_bias, allowed_token_ids) instead")


def _check_count(param: str, what: str, count: int, limit: int) -> None:
    if count > limit:
        raise InvalidRequestError(param, f"at most {limit} {what} are supported, got {count}")
