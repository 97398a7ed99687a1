"""OpenAI API schemas (pydantic), with vLLM's extra sampling fields: what completions and chat
share (SamplingRequest, usage, errors, model cards, messages), completions, and /tokenize.
Chat's own schemas are in protocol_chat.py, tools and response formats in protocol_tools.py."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from jaxlm.serve.protocol_tools import ResponseFormat

# Upper bound of `n`: one request must not monopolise the engine (vLLM has no hard limit, but a
# huge n is a malformed request here).
MAX_N = 128
# Upper bound of a client's request id (the request_id field, the X-Request-Id header): it is
# logged and echoed in every response chunk.
MAX_REQUEST_ID_LEN = 256


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted (clients send extras freely); requests check them with
    # unsupported_field() / ignored_fields().
    model_config = ConfigDict(extra="allow")


# Fields of OpenAI's or vLLM's request schemas that jaxlm does not implement: a request that
# sets one to anything but its "off" value gets a 400 naming it, rather than a silent 200. The
# off values (None, False, 0, empty, and the ones listed) mean what leaving the field out means.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "guided_decoding_backend": (),
    "functions": (),
    "function_call": ("none", "auto"),
    "prompt_embeds": (),
    "logits_processors": (),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "mm_processor_kwargs": (),
    "documents": (),
    "reasoning_effort": (),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "service_tier": ("auto", "default"),
    "store": (),
    "metadata": (),
    "echo": (),  # chat only (completions implement it)
}


def _is_off(name: str, value: Any) -> bool:
    if value is None or value is False or value == 0 or (isinstance(value, (str, list, dict)) and not value):
        return True
    return any(value == off for off in UNSUPPORTED_FIELDS[name])


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_view: bool = True
    organization: str = "*"
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxlm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_LEN)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)
    # Keep only the last N prompt tokens (-1: the last max_model_len - 1), as vLLM.
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # Logprob tokens as "token_id:N" (for tokens that are not valid UTF-8 alone), as vLLM.
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the choices carry token_ids (a stream's chunks their new ones) and the prompt's
    # prompt_token_ids (a stream's first chunk): what --skip-tokenizer-init clients read.
    return_token_ids: bool | None = None
    best_of: int | None = None
    # --scheduling-policy priority: lower runs first (any other value under fcfs is a 400).
    priority: int = 0
    # Beam search (vLLM's): n beams, ranked by cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Output constraints (serve/structured.py reads them; at most one per request): OpenAI's
    # response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def unsupported_field(self) -> str | None:
        """The first field of the OpenAI / vLLM schema set here that jaxlm does not implement."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and not _is_off(name, value):
                return name
        return None

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams | None:
        """use_beam_search: the beam search the request's resolved params describe (n beams)."""
        if not self.use_beam_search:
            return None
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=self.length_penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output)

    def token_ids_fields(self, token_ids: list[int] | None = None,
                         prompt_token_ids: list[int] | None = None) -> dict[str, list[int]]:
        """return_token_ids: the extra fields of a choice (or response); {} otherwise, so other
        responses keep their exact shape."""
        if not self.return_token_ids:
            return {}
        fields = {} if token_ids is None else {"token_ids": list(token_ids)}
        if prompt_token_ids is not None:
            fields["prompt_token_ids"] = list(prompt_token_ids)
        return fields

    def ignored_fields(self) -> list[str]:
        """Fields in neither schema: ignored (with a warning), as vLLM."""
        return sorted(set(self.model_extra or {}) - set(UNSUPPORTED_FIELDS))

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                         defaults: dict[str, Any]) -> SamplingParams:
        """defaults: the model's generation-config sampling fields; what the request leaves
        unset takes them, else vLLM's (temperature 1.0, top_p 1.0, top_k off)."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_logit_bias(self.logit_bias),
            # DELTA even without streaming: the server accumulates, and sees every token arrive
            # (TTFT / inter-token metrics) at the cost of one small hand-off per step.
            output_kind=RequestOutputKind.DELTA,
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        ids = [int(k) for k in bias]
    except ValueError as e:
        raise ValueError(f"logit_bias keys must be token ids, got {list(bias)!r}") from e
    if not all(math.isfinite(v) for v in bias.values()):  # NaN would clamp to a silent +100
        raise ValueError("logit_bias values must be finite numbers")
    # OpenAI clamps biases to [-100, 100].
    return {i: max(-100.0, min(100.0, float(v))) for i, v in zip(ids, bias.values())}


# ------------------------------------------------------------------- completions
class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: score the prompt only (one token is generated and not returned), as vLLM.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
        # echo + logprobs needs the prompt's logprobs too (OpenAI returns them for the prompt).
        prompt_lp = self.prompt_logprobs
        if prompt_lp is None and self.echo and self.logprobs is not None:
            prompt_lp = self.logprobs
        return self._sampling_params(max_tokens, self.logprobs, prompt_lp, defaults)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob as JSON (prompt_logprobs entries)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    usage: UsageInfo | None = None


# ------------------------------------------------------------------- messages (chat, /tokenize)
class ChatMessage(OpenAIBaseModel):
    role: str
    # str, or OpenAI content parts [{"type": "text", "text": ...}]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


# ------------------------------------------------------------------- tokenize
class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
