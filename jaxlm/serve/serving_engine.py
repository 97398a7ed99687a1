"""OpenAIServing: what completions and chat share — model check, tokenization, length checks,
metrics around the engine stream, logprob entries (the response formatting is stream_utils')."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any


from jaxlm.engine.async_llm_engine import AsyncLLMEngine
from jaxlm.engine.exceptions import QueueFullError
from jaxlm.engine.input_processor import InvalidRequestError, ProcessedPrompt, PromptTooLongError
from jaxlm.outputs import CompletionOutput, Logprob, RequestOutput, RequestStateStats
from jaxlm.sampling_params import BeamSearchParams, SamplingParams
from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.metrics import ServerMetrics
from jaxlm.serve.protocol import MAX_REQUEST_ID_LEN, SamplingRequest, random_uuid
from jaxlm.serve.serving_models import ServingModels
from jaxlm.serve.request_logger import RequestLogger
from jaxlm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class _SeqProgress:
    """What the server saw of one of a request's n sequences (for /metrics)."""

    stats: RequestStateStats | None = None
    last_token: float | None = None
    num_tokens: int = 0
    finished: bool = False


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: list[str],
        max_model_len: int,
        metrics: ServerMetrics,
        chat_template: str | None = None,
        request_logger: RequestLogger | None = None,
        models: ServingModels | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        # The base model's names and the LoRA adapters (a request's model may name one).
        self.models = models or ServingModels(engine, served_model_names, None, max_model_len)
        self.max_model_len = max_model_len
        self.metrics = metrics
        # The engine's --max-logprobs, checked before any per-logprob work (not a fixed cap here).
        self.max_logprobs = engine.engine_config.model_config.max_logprobs
        # The model's generation-config sampling defaults (the engine logged them at start-up):
        # request fields override them, unset fields take them (vLLM's --generation-config auto).
        self.default_sampling_params = dict(engine.get_diff_sampling_param())
        # The server's --chat-template, else the engine's (None: the tokenizer's own;
        # entrypoints/chat_utils.py decides).
        self.chat_template = chat_template or engine.engine_config.model_config.chat_template
        self.request_logger = request_logger  # --enable-log-requests

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model or LoRA adapter this server does not serve."""
        return self.models.check_model(model)

    def check_engine(self) -> None:
        if not self.engine.is_running:
            raise OpenAIError("the engine is not running", 503)

    def check_request_fields(self, request: SamplingRequest) -> None:
        """400 naming a schema field jaxlm does not implement; fields in neither schema are
        ignored with a warning (as vLLM)."""
        name = request.unsupported_field()
        if name is not None:
            raise OpenAIError(f"{name} is not supported by this server", 400, name)
        ignored = request.ignored_fields()
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", ignored)
        if request.stream and request.prompt_logprobs is not None:
            raise OpenAIError("prompt_logprobs are not available when stream is enabled", 400, "prompt_logprobs")
        if request.stream and request.use_beam_search:
            raise OpenAIError("use_beam_search does not support streaming: its beams are ranked only at the "
                              "end; send stream=false", 400, "stream")

    @staticmethod
    def _base_request_id(raw_request: Any, default: str | None = None) -> str:
        """vLLM's: the X-Request-Id header when the client (a proxy, a gateway) sends one, else
        `default` (the body's request_id), else a random id. Responses and the request log carry
        it; the engine keys each request by its own internal id, so live requests may share it."""
        header = raw_request.headers.get("X-Request-Id") if raw_request is not None else None
        if header is not None and len(header) > MAX_REQUEST_ID_LEN:
            raise OpenAIError(f"the X-Request-Id header has {len(header)} characters; at most "
                              f"{MAX_REQUEST_ID_LEN}", 400)
        return header or default or random_uuid()

    def require_tokenizer(self, param: str | None, what: str) -> None:
        """400 for what needs text when the server runs with --skip-tokenizer-init."""
        if self.tokenizer is None:
            raise OpenAIError(f"{what} needs a tokenizer, and this server runs with --skip-tokenizer-init: "
                              "send token ids", 400, param)

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text ("" without a tokenizer: --skip-tokenizer-init)."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def truncate(self, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last N prompt tokens (-1: max_model_len), vLLM's truncate_prompt_tokens."""
        if truncate_prompt_tokens is None:
            return ids
        n = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if n > self.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens ({n}) is greater than max_model_len "
                              f"({self.max_model_len}); please request a smaller value", 400,
                              "truncate_prompt_tokens")
        return ids[-n:] if n else []

    @property
    def input_processor(self) -> Any:
        """The engine's InputProcessor: the one place prompts and params are checked."""
        return self.engine.get_input_processor()

    def check_token_ids(self, ids: list[int]) -> None:
        try:
            self.input_processor.check_prompt_token_ids(ids)
        except InvalidRequestError as e:
            raise OpenAIError(str(e), 400, e.param) from e

    def resolve_max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """Rejects prompts that fill the context; clamps max_tokens to the room left (as vLLM)."""
        ip = self.input_processor
        try:
            ip.check_prompt_len(prompt_len)
        except PromptTooLongError as e:
            raise _context_length_error(e) from e
        return ip.max_tokens_for(prompt_len, requested)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.require_tokenizer("prompt", "a text prompt")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot take
            raise OpenAIError(f"the text cannot be tokenized: {e}", 400, "prompt") from e

    def beam_search_params(self, request: SamplingRequest, params: SamplingParams) -> BeamSearchParams | None:
        """use_beam_search: n beams over the request's resolved params (no output constraint)."""
        if not request.use_beam_search:
            return None
        if params.structured_outputs is not None:
            raise OpenAIError("use_beam_search does not support output constraints (response_format, "
                              "structured_outputs, tool_choice)", 400, "use_beam_search")
        try:
            return request.beam_search_params(params)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "length_penalty" if "length_penalty" in str(e) else "n") from e

    def build_params(self, make: Any, max_tokens: int,
                     structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """make(max_tokens, defaults) -> SamplingParams, with the request's output constraint
        (serve/structured.py; compiled when the engine admits the request)."""
        try:
            params = make(max_tokens, self.default_sampling_params)
        except ValueError as e:  # SamplingParams' own validation: a client error
            param = str(e).split(" ", 1)[0]
            raise OpenAIError(str(e), 400, param if param.isidentifier() else None) from e
        for name, n in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if n is not None and n > self.max_logprobs:
                raise OpenAIError(f"Requested {name}={n} exceeds max_logprobs={self.max_logprobs}; "
                                  "start the server with a larger --max-logprobs", 400, name)
        params.structured_outputs = structured_outputs
        return params

    # ------------------------------------------------------------ generation
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, arrival_time: float,
        prompt_text: str | None = None, priority: int = 0, beam_search: BeamSearchParams | None = None,
        model: str | None = None, mm_features: list[Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """engine.generate plus the request-level metrics (and log lines, --enable-log-requests);
        arrival_time (time.time()) is when the server got the request, before tokenization: TTFT
        and e2e latency count from it. prompt_text: the client's text, when it sent one. With
        beam_search, one final output with a completion per beam (AsyncLLMEngine.beam_search).

        prompt_ids have passed check_token_ids and resolve_max_tokens (the InputProcessor's
        prompt checks), so the engine takes them as a ProcessedPrompt without checking again.
        model: the checked model name; a LoRA adapter's name runs the request with it. mm_features:
        a chat's images, as the InputProcessor made them with prompt_ids."""
        seqs: dict[int, _SeqProgress] = {}
        rejected = False
        prompt = ProcessedPrompt(None, list(prompt_ids), mm_features)
        if self.request_logger is not None:
            self.request_logger.log_inputs(request_id, prompt_text, prompt.prompt_token_ids, params)
        lora_request = self.models.lora_request(model)
        if beam_search is not None:
            outputs = self._beam_search(prompt, request_id, beam_search, priority, lora_request)
        else:
            outputs = self.engine.generate(prompt, params, request_id, arrival_time=arrival_time, priority=priority,
                                           lora_request=lora_request)
        try:
            async for out in outputs:
                now = time.time()
                for o in out.outputs:
                    seq = seqs.setdefault(o.index, _SeqProgress())
                    self._observe_output(seq, o, out, now, arrival_time, len(prompt_ids), params)
                yield out
        except PromptTooLongError as e:
            rejected = True  # never ran: not a finished request
            raise _context_length_error(e) from e
        except InvalidRequestError as e:
            rejected = True
            raise OpenAIError(str(e), 400, e.param) from e
        except (ValueError, QueueFullError):
            rejected = True
            raise
        finally:
            if not rejected:
                self._observe_end(seqs, arrival_time, len(prompt_ids), params, request_id)

    async def _beam_search(self, prompt: ProcessedPrompt, request_id: str, params: BeamSearchParams,
                           priority: int, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        self.input_processor.check_priority(priority)  # the beams' requests would each refuse it
        try:
            yield await self.engine.beam_search(prompt, request_id, params, priority=priority,
                                                lora_request=lora_request)
        except ValueError as e:
            if isinstance(e, InvalidRequestError) or "beam_width" not in str(e):
                raise
            raise InvalidRequestError("n", str(e).replace("beam_width", "n")) from e

    def _observe_output(self, seq: "_SeqProgress", o: CompletionOutput, out: RequestOutput, now: float,
                        arrival_time: float, prompt_len: int, params: SamplingParams) -> None:
        seq.stats = out.metrics
        engine = _engine_index(seq)
        if o.token_ids:
            if seq.last_token is None:
                latency = out.metrics.first_token_latency if out.metrics is not None else None
                self.metrics.observe_first_token(latency if latency is not None else now - arrival_time, engine)
            else:
                self.metrics.observe_inter_token(now - seq.last_token, engine)
            seq.last_token = now
            seq.num_tokens += len(o.token_ids)
        if o.finish_reason is not None and not seq.finished:
            seq.finished = True
            self.metrics.observe_sequence_finished(o.finish_reason, prompt_len, params.n, params.max_tokens,
                                                   seq.stats, seq.num_tokens, now - arrival_time, engine)

    def _observe_end(self, seqs: dict[int, "_SeqProgress"], arrival_time: float, prompt_len: int,
                     params: SamplingParams, request_id: str) -> None:
        """Sequences that never finished were aborted (client gone, shutdown)."""
        now = time.time()
        if self.request_logger is not None and not all(seqs.get(i, _SeqProgress()).finished for i in range(params.n)):
            self.request_logger.log_aborted(request_id)
        # A request's n sequences run on one core; one aborted before its first output is
        # counted under its siblings' core (engine 0 when none ever reported).
        engine = next((_engine_index(s) for s in seqs.values() if s.stats is not None), 0)
        for i in range(params.n):
            seq = seqs.setdefault(i, _SeqProgress())
            if not seq.finished:
                self.metrics.observe_sequence_finished("abort", prompt_len, params.n, params.max_tokens,
                                                       seq.stats, seq.num_tokens, now - arrival_time, engine)
        self.metrics.observe_request_finished(max(s.num_tokens for s in seqs.values()), engine)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's class, config and chat template (what lm-eval's
        remote tokenizer reads: eos/bos/pad tokens, chat_template)."""
        self.require_tokenizer(None, "/tokenizer_info")
        tok = self.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
        for key, value in getattr(tok, "init_kwargs", {}).items():
            value = _jsonable(value)
            if value is not None:
                info[key] = value
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[key] = getattr(tok, key, None)
        info["chat_template"] = self.chat_template or getattr(tok, "chat_template", None)
        info["model_max_length"] = self.max_model_len
        return info

    # ------------------------------------------------------------ logprobs
    def token_str(self, token_id: int, lp: Logprob | None = None, as_token_id: bool = False) -> str:
        """A logprob entry's token: its text, or "token_id:N" (return_tokens_as_token_ids)."""
        if as_token_id:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:  # --skip-tokenizer-init
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def top_entries(self, position: dict[int, Logprob], limit: int | None) -> list[tuple[int, Logprob]]:
        items = sorted(position.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
        return items if limit is None else items[:limit]


def _engine_index(seq: _SeqProgress) -> int:
    """The engine core serving a sequence, as its outputs' stats say (/metrics' `engine`)."""
    return seq.stats.engine_index if seq.stats is not None else 0


def _jsonable(value: Any) -> Any:
    """A JSON value (AddedToken -> its text), or None for what JSON cannot hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers.AddedToken
        return value.content
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return None if any(v is None for v in items) else items
    if isinstance(value, dict):
        items = {str(k): _jsonable(v) for k, v in value.items()}
        return None if any(v is None for v in items.values()) else items
    return None


def _context_length_error(e: PromptTooLongError) -> OpenAIError:
    return OpenAIError(
        f"This model's maximum context length is {e.max_model_len} tokens. However, your "
        f"request has {e.prompt_len} input tokens. Please reduce the length of the input.",
        400,
        "prompt",
    )
