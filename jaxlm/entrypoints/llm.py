"""LLM: the offline API (vLLM's names): generate() and chat() over an LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from tqdm import tqdm

from jaxlm.beam_search import BeamSearch, BeamSearchOutput, run_beam_search
from jaxlm.config.model import load_chat_template
from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.entrypoints.chat_utils import apply_chat_template, parse_chat_messages
from jaxlm.entrypoints.llm_pooling import PoolingMethods
from jaxlm.engine.input_processor import PromptType
from jaxlm.engine.llm_engine import LLMEngine
from jaxlm.lora.request import LoRARequest
from jaxlm.outputs import RequestOutput
from jaxlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]

# vLLM's LLM(...) arguments that jaxlm has no field for: accepted at the value that means what
# jaxlm always does, refused with a clear message otherwise.
_VLLM_FIXED_ARGS: dict[str, tuple[Any, str]] = {
    "tokenizer_mode": ("auto", "jaxlm loads HF fast tokenizers only"),
    "tokenizer_revision": (None, "pass a tokenizer directory as tokenizer="),
    "enable_chunked_prefill": (True, "jaxlm always chunks prefills into the step budget"),
    "cpu_offload_gb": (0, "jaxlm does not offload weights"),
    "hf_overrides": (None, "the model's config.json is used as it is"),
}


def _engine_args(model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in sorted(set(kwargs) & set(_VLLM_FIXED_ARGS)):
        expected, why = _VLLM_FIXED_ARGS[name]
        if kwargs.pop(name) != expected:
            raise ValueError(f"{name}={expected!r} is the only value jaxlm supports: {why}")
    unknown = set(kwargs) - fields
    if unknown:
        raise TypeError(f"Unknown engine argument(s): {', '.join(sorted(unknown))} "
                        "(jaxlm's are the fields of jaxlm.EngineArgs)")
    kwargs.setdefault("disable_log_stats", True)  # vLLM's LLM default: no periodic stats line
    return EngineArgs(model=model, **kwargs)


def make_engine(engine_args: EngineArgs) -> Any:
    """An LLMEngine, or a PoolingEngine when the flags or the architecture ask for pooling."""
    from jaxlm.engine.pooling_engine import PoolingEngine, wants_pooling_runner

    config = engine_args.create_engine_config()
    if wants_pooling_runner(config):
        return PoolingEngine(config)
    return LLMEngine(config)


class LLM(PoolingMethods):
    """An offline engine. `model=None` serves the embedded default (SmolLM2-135M-Instruct).
    Embedding, classification and cross-encoder models (``runner="pooling"``, or chosen by their
    architecture) run on the pooling runner: embed(), classify(), score(), encode(), reward()."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        """``kwargs``: any EngineArgs field (tokenizer=, dtype=, max_model_len=, trust_remote_code=,
        revision=, max_logprobs=, ...), as vLLM's LLM takes them."""
        self.llm_engine = make_engine(_engine_args(model, kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_metrics(self) -> list[Any]:
        """The engine's metrics now, as vLLM's metrics reader gives them (jaxlm.metrics.reader's
        Counter / Gauge / Histogram / Vector objects): the engine-level series of /metrics,
        speculative decoding's included."""
        from prometheus_client import CollectorRegistry

        from jaxlm.metrics.reader import get_metrics_snapshot
        from jaxlm.serve.metrics import EngineStatsCollector, cache_config_info

        engine = self.llm_engine
        registry = CollectorRegistry()
        registry.register(EngineStatsCollector(str(engine.model_config.model), engine.get_stats,
                                               cache_config_info(engine.engine_config.cache_config),
                                               engine.engine_config.model_config))
        return get_metrics_snapshot(registry)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's name)."""
        return self.llm_engine.get_default_sampling_params()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. priority: one per
        prompt, lower first (needs scheduling_policy="priority" unless all are 0). lora_request: the
        adapter for every prompt, or one per prompt (None: the base model; needs enable_lora=True)."""
        self._require_generate("generate")
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"Got {len(sampling_params)} sampling params for {len(prompts)} prompts: pass one or one per prompt")
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts: pass one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"Got {len(loras)} lora requests for {len(prompts)} prompts: pass one or one per prompt")
        ids = []
        try:
            for prompt, params, prio, lora in zip(prompts, sampling_params, priority, loras):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._request_counter))
                ids.append(self.llm_engine.add_request(request_id, prompt, params, priority=prio, lora_request=lora))
        except Exception:
            self.llm_engine.abort_request(ids, internal=True)
            raise
        return self._run_engine(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (jaxlm/beam_search.py): per prompt, the beam_width best sequences;
        each beam is one request per step, sharing the prompt's KV blocks through the prefix
        cache. A sequence's tokens and text include the prompt's (as vLLM's LLM.beam_search)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        ids = [engine.input_processor.process_prompt(p).prompt_token_ids for p in prompts]
        mc = engine.model_config
        search = BeamSearch(ids, params, engine.eos_token_id, mc.max_model_len, mc.max_logprobs)
        tokenizer = self.get_tokenizer()
        return run_beam_search(
            search, lambda step, sp: self.generate([{"prompt_token_ids": t} for t in step], sp, use_tqdm=use_tqdm,
                                          lora_request=lora_request),
            tokenizer.decode if tokenizer is not None else None)

    def chat(self, messages: ChatMessages | list[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template (this call's chat_template, else
        LLM(chat_template=...), else the tokenizer's: a file's path or the template itself),
        then generate. tools (OpenAI's {"type": "function", "function": {...}} dicts) reach the
        template as ``tools``; to force a call, constrain the output
        (SamplingParams(structured_outputs=...))."""
        self._require_generate("chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() renders messages with the tokenizer's chat template, and this LLM was "
                             "built with skip_tokenizer_init=True: pass token ids to generate() instead")
        template = load_chat_template(chat_template) or self.llm_engine.model_config.chat_template
        prompts = []
        inputs = self.llm_engine.get_input_processor()
        for conversation in conversations:
            images = inputs.chat_images()  # image_url parts (None: a text-only model refuses them)
            text = apply_chat_template(tokenizer, parse_chat_messages(conversation, images), template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools,
                                       **(chat_template_kwargs or {}))
            # The template carries BOS: no special tokens added again (as the server).
            if images is not None and images.images:
                prompts.append(inputs.process_multimodal(text, images.images, add_special_tokens=False))
            else:
                prompts.append({"prompt_token_ids": list(tokenizer.encode(text, add_special_tokens=False))})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """ids: the engine's internal ids, in input order."""
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        while engine.has_unfinished_requests():
            for internal_id, out in engine.step_routed():
                if out.finished:
                    done[internal_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
