"""PoolingEngine: the pooling runner's engine — admit (tokenize, validate), schedule (prefill
only), run, finish each output (vLLM's pooling runner, for embedding, classification and
cross-encoder models). ``LLM(..., runner="pooling")`` and the server's pooling routes drive it.

In-process by design: a pooling request is one forward pass, with no decode loop to overlap and
no KV cache, so the front end calls the runner directly (the server from one engine thread,
``AsyncPoolingEngine``)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import threading
from typing import Any, Sequence

import numpy as np

from jaxlm.config import EngineConfig
from jaxlm.core.pooling_scheduler import PoolingBuckets, PoolingRequest, PoolingScheduler, default_seq_buckets
from jaxlm.engine.input_processor import InvalidRequestError
from jaxlm.model_loader import get_tokenizer, resolve_model_config
from jaxlm.model_loader.loader import get_model_class
from jaxlm.outputs_pooling import PoolingOutput, PoolingRequestOutput
from jaxlm.pooling.postprocess import finish_output
from jaxlm.pooling.resolve import PoolerSpec, pooling_architecture, resolve_pooler_spec, use_pooling_runner
from jaxlm.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

# A prompt: text, token ids, {"prompt": text} / {"prompt_token_ids": ids}, or a (text, text)
# pair for a cross-encoder.
PoolingPrompt = Any


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(param, message)


def wants_pooling_runner(config: EngineConfig) -> bool:
    """Whether the pooling runner serves this config (the flags, else the architecture and a
    sentence-transformers checkpoint); reads the model's config.json, changes nothing."""
    mc = resolve_model_config(config.model_config, config.load_config)
    return use_pooling_runner(config.pooling_config, mc.hf_config, mc.model)


class PoolingEngine:
    def __init__(self, config: EngineConfig):
        from jaxlm.worker.pooling_runner import PoolingModelRunner

        self.engine_config = config
        mc = config.model_config = resolve_model_config(config.model_config, config.load_config)
        # The architecture the runner loads (a *ForCausalLM becomes *Model / *ForSequenceClassification).
        arch = pooling_architecture(config.pooling_config, mc.hf_config)
        hf_config = copy.deepcopy(mc.hf_config)
        hf_config.architectures = [arch]
        mc.hf_config = hf_config
        model_cls = get_model_class(mc)
        limit = model_cls.max_prompt_len(hf_config) if hasattr(model_cls, "max_prompt_len") else None
        if limit is not None and mc.max_model_len > limit:
            logger.info("max_model_len %d -> %d: the model's position table holds %d prompt positions",
                        mc.max_model_len, limit, limit)
            mc.max_model_len = limit
        config.scheduler_config.max_model_len = mc.max_model_len
        self.model_config = mc
        self.tokenizer = None if mc.skip_tokenizer_init else get_tokenizer(mc)
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers refuse concurrent truncation changes
        sc = config.scheduler_config
        self.max_model_len = int(mc.max_model_len)
        budget = max(sc.max_num_batched_tokens, self.max_model_len)
        self.buckets = PoolingBuckets(default_seq_buckets(self.max_model_len), budget, sc.max_num_seqs)
        self.scheduler = PoolingScheduler(self.buckets)
        self.runner = PoolingModelRunner(config, self.buckets)
        # The pooling type decides the programs: the family's default, sentence-transformers', the flag's.
        self.spec: PoolerSpec = resolve_pooler_spec(
            config.pooling_config, hf_config, mc.model, default_pooling_type=self.runner.model.default_pooling_type,
            hidden_size=self.runner.hidden_size, num_labels=self.runner.num_labels)
        self.runner.set_pooling_type(self.spec.pooling_type)
        self.runner.warmup()
        self.vocab_size = int(hf_config.vocab_size)
        self._serial = itertools.count()
        self._live: dict[str, PoolingRequest] = {}
        self.stats = {"num_requests_finished": 0, "prompt_tokens_total": 0, "num_steps": 0}
        logger.info("pooling runner: %s, %s pooling, tasks %s, %d programs", arch, self.spec.pooling_type,
                    ", ".join(self.spec.supported_tasks), len(self.buckets.programs()))

    # ----- admission ------------------------------------------------------------------------
    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.spec.supported_tasks

    def check_task(self, task: str) -> None:
        if task not in self.spec.supported_tasks:
            what = (f"a classifier with {self.spec.num_labels} labels" if self.spec.has_head
                    else "an embedding model")
            raise _invalid(f"task {task!r} is not supported by this model ({what}); it supports: "
                                      f"{', '.join(self.spec.supported_tasks)}", "task")

    def _check_params(self, params: PoolingParams, task: str) -> None:
        if params.dimensions is not None:
            if self.spec.has_head:
                raise _invalid("dimensions applies to embeddings; this model is a classifier", "dimensions")
            if params.dimensions > self.spec.hidden_size:
                raise _invalid(f"dimensions={params.dimensions} is larger than the model's embedding size "
                                          f"{self.spec.hidden_size}", "dimensions")

    def tokenize(self, prompts: Sequence[PoolingPrompt], truncate: int | None) -> list[tuple[list[int], list[int] | None]]:
        """Token ids (and token type ids for pairs) of each prompt, texts tokenized in one call."""
        out: list[Any] = [None] * len(prompts)
        texts, pairs = [], []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = p["prompt_token_ids"]
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise _invalid("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
            if isinstance(p, str):
                texts.append((i, p))
            elif isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(x, str) for x in p):
                pairs.append((i, p))
            elif isinstance(p, (list, tuple, np.ndarray)):
                ids = [int(t) for t in p] if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                 for t in p) else None
                if ids is None:
                    raise _invalid("token ids must be integers", "prompt")
                if truncate is not None:
                    ids = ids[-(self.max_model_len if truncate == -1 else truncate):]
                out[i] = (ids, None)
            else:
                raise _invalid(f"a prompt must be text, token ids or a (text, text) pair, "
                                          f"got {type(p).__name__}", "prompt")
        if (texts or pairs) and self.tokenizer is None:
            raise _invalid("text prompts need a tokenizer (skip_tokenizer_init=True): pass token ids",
                                      "prompt")
        kw: dict[str, Any] = {}
        if truncate is not None:
            kw = dict(truncation=True, max_length=self.max_model_len if truncate == -1 else truncate)
        with self._tokenizer_lock:
            if texts:
                enc = self.tokenizer([t for _, t in texts], **kw)
                for (i, _), ids in zip(texts, enc["input_ids"]):
                    out[i] = (list(ids), None)
            if pairs:
                enc = self.tokenizer([a for _, (a, _) in pairs], [b for _, (_, b) in pairs], **kw)
                types = enc.get("token_type_ids") if self.runner.model.uses_token_types else None
                for k, ((i, _), ids) in enumerate(zip(pairs, enc["input_ids"])):
                    out[i] = (list(ids), list(types[k]) if types is not None else None)
        return out

    def make_request(self, request_id: str, tokens: tuple[list[int], list[int] | None], params: PoolingParams,
                     task: str) -> PoolingRequest:
        ids, types = tokens
        if not ids:
            raise _invalid("the prompt is empty (0 tokens)", "input")
        if len(ids) > self.max_model_len:
            raise _invalid(
                f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}: shorten it or set "
                "truncate_prompt_tokens", "input")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise _invalid(f"token id {lo if lo < 0 else hi} is out of the vocabulary "
                                      f"[0, {self.vocab_size})", "input")
        return PoolingRequest(request_id, ids, types, params, task)

    def process_requests(self, prompts: Sequence[PoolingPrompt], params: PoolingParams | Sequence[PoolingParams],
                         task: str, request_ids: Sequence[str] | None = None) -> list[PoolingRequest]:
        """Validate and tokenize a whole call; raises (naming the problem) before any is queued."""
        self.check_task(task)
        plist = list(params) if isinstance(params, (list, tuple)) else [params or PoolingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"Got {len(plist)} pooling params for {len(prompts)} prompts: pass one or one per prompt")
        for p in plist:
            self._check_params(p, task)
        truncs = {p.truncate_prompt_tokens for p in plist}
        if len(truncs) == 1:
            tokens = self.tokenize(prompts, truncs.pop())
        else:
            tokens = [self.tokenize([pr], p.truncate_prompt_tokens)[0] for pr, p in zip(prompts, plist)]
        ids = request_ids or [str(next(self._serial)) for _ in prompts]
        return [self.make_request(rid, t, p, task) for rid, t, p in zip(ids, tokens, plist)]

    # ----- running --------------------------------------------------------------------------
    def add_requests(self, reqs: Sequence[PoolingRequest]) -> None:
        for r in reqs:
            if r.request_id in self._live:
                raise ValueError(f"request id {r.request_id!r} is already running")
        for r in reqs:
            self._live[r.request_id] = r
            self.scheduler.add_request(r)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        ids = set(request_ids)
        self.scheduler.abort_requests(ids)
        for rid in ids:
            self._live.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[PoolingRequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        raws = self.runner.execute(batch)
        outs = []
        for req, raw in zip(batch.requests, raws):
            self._live.pop(req.request_id, None)
            data = finish_output(raw, req.params, self.spec, req.task)
            outs.append(PoolingRequestOutput(req.request_id, PoolingOutput(data), req.prompt_token_ids))
            self.stats["prompt_tokens_total"] += req.num_tokens
        self.stats["num_requests_finished"] += len(outs)
        self.stats["num_steps"] += 1
        return outs

    def encode(self, prompts: Sequence[PoolingPrompt], params: PoolingParams | Sequence[PoolingParams] | None,
               task: str) -> list[PoolingRequestOutput]:
        """Run a whole call to completion; outputs in input order."""
        reqs = self.process_requests(prompts, params or PoolingParams(), task)
        self.add_requests(reqs)
        done: dict[str, PoolingRequestOutput] = {}
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    done[out.request_id] = out
        except BaseException:
            self.abort_requests([r.request_id for r in reqs])
            raise
        return [done[r.request_id] for r in reqs]

    def get_stats(self) -> dict[str, Any]:
        return {"num_requests_running": 0, "num_requests_waiting": self.scheduler.num_waiting,
                "kv_cache_usage_perc": 0.0, "prompt_tokens_total": self.stats["prompt_tokens_total"]}

    @property
    def num_compiles_after_warmup(self) -> int:
        return self.runner.num_compiles_after_warmup
