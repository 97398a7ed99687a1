"""A unit-test double of LLMEngine: same API, deterministic tokens, no model.

It cycles through the tokens of a fixed sentence, starting at an offset derived from the prompt
(greedy) or from a seeded RNG (temperature > 0), so outputs are predictable without JAX. The
real-engine tests (test_real_engine.py) are the ones that prove the server on a real model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from typing import Any

from transformers import AutoTokenizer

from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.engine.exceptions import QueueFullError
from jaxlm.engine.input_processor import InputProcessor, make_internal_request_id
from jaxlm.outputs import CompletionOutput, Logprob, RequestStateStats, RequestOutput
from jaxlm.sampling_params import RequestOutputKind, SamplingParams

SENTENCE = "the quick brown fox jumps over the lazy dog while the cat sleeps "
NUM_BLOCKS = 256
BLOCK_SIZE = 16


@dataclasses.dataclass
class _Child:
    index: int
    rng: random.Random
    offset: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    text: str = ""
    sent_text: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None
    finish_sent: bool = False


@dataclasses.dataclass
class _Req:
    request_id: str
    internal_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    metrics: RequestStateStats

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class FakeLLMEngine:
    def __init__(self, tokenizer_dir: str, *, max_model_len: int = 256, max_num_seqs: int = 8,
                 max_num_queued_reqs: int | None = None, step_delay: float = 0.002) -> None:
        self.engine_config = EngineArgs(
            model=tokenizer_dir, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_queued_reqs=max_num_queued_reqs,
        ).create_engine_config()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.eos_token_id = self.tokenizer.eos_token_id  # as LLMEngine (beam search reads it)
        self.cycle = self.tokenizer.encode(SENTENCE, add_special_tokens=False)
        self.step_delay = step_delay
        self.max_num_seqs = max_num_seqs
        self.running: list[_Req] = []
        self.waiting: list[_Req] = []
        self.counters = dict(prompt_tokens_total=0, generation_tokens_total=0, prefix_cache_queries=0,
                             prefix_cache_hits=0, num_preemptions_total=0)
        self.fail_on_step: BaseException | None = None  # tests kill the loop with this
        self._serial = itertools.count()
        # The real admission path, minus the sampler's own check (there is no sampler).
        self.input_processor = InputProcessor(
            self.tokenizer, max_model_len, len(self.tokenizer), self.tokenizer.eos_token_id, set(),
            check_params=lambda params: None)

    def wakeup(self) -> None:
        """Nothing to wake: step_routed never waits."""

    def check_health(self) -> None:
        """No core process to lose."""

    def shutdown(self) -> None:
        """No core process to stop."""

    def get_input_processor(self) -> InputProcessor:
        return self.input_processor

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return {}

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                    arrival_time: float | None = None, *, internal_request_id: str | None = None,
                    priority: int = 0, lora_request: Any = None) -> str:
        if lora_request is not None:
            raise ValueError("the fake engine serves no LoRA adapters")
        self.input_processor.check_request_id(request_id)
        self.input_processor.check_priority(priority)  # fcfs: only 0 passes
        internal_id = internal_request_id or make_internal_request_id(request_id, next(self._serial))
        processed = self.input_processor.process_prompt(prompt)
        prompt, ids = processed.prompt, processed.prompt_token_ids
        params = self.input_processor.process_params(params, len(ids))
        if any(r.internal_id == internal_id for r in self.running + self.waiting):
            raise ValueError(f"duplicate request id {internal_id}")
        max_queued = self.engine_config.scheduler_config.max_num_queued_reqs
        if max_queued is not None and len(self.waiting) >= max_queued:
            raise QueueFullError(f"The waiting queue is full ({max_queued} requests)")
        children = []
        for i in range(params.n):
            if params.greedy:
                rng, offset = random.Random(0), sum(ids) % len(self.cycle)
            else:
                seed = params.seed * 1000 + i if params.seed is not None else random.getrandbits(32)
                rng = random.Random(seed)
                offset = rng.randrange(len(self.cycle))
            children.append(_Child(i, rng, offset))
        req = _Req(request_id, internal_id, prompt, ids, params, children,
                   RequestStateStats(arrival_time=arrival_time or time.time()))
        self.waiting.append(req)
        return internal_id

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        ids = set(request_ids)
        key = (lambda r: r.internal_id) if internal else (lambda r: r.request_id)
        self.running = [r for r in self.running if key(r) not in ids]
        self.waiting = [r for r in self.waiting if key(r) not in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def get_stats(self) -> dict[str, Any]:
        used = sum(math.ceil((len(r.prompt_ids) + max(len(c.token_ids) for c in r.children)) / BLOCK_SIZE)
                   for r in self.running)
        return dict(num_requests_running=len(self.running), num_requests_waiting=len(self.waiting),
                    kv_cache_usage_perc=used / NUM_BLOCKS, **self.counters)

    def step(self) -> list[RequestOutput]:
        return [out for _, out in self.step_routed()]

    def step_routed(self, timeout: float | None = None) -> list[tuple[str, RequestOutput]]:
        if self.fail_on_step is not None:
            raise self.fail_on_step
        time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop(0)
            self.counters["prompt_tokens_total"] += len(req.prompt_ids)
            self.running.append(req)
        outputs = []
        for req in self.running:
            for child in req.children:
                if child.finish_reason is None:
                    self._sample(req, child)
            outputs.append((req.internal_id, self._output(req)))
        self.running = [r for r in self.running if not r.finished]
        return [(i, o) for i, o in outputs if o is not None]

    def _sample(self, req: _Req, child: _Child) -> None:
        p = req.params
        pos = child.offset + len(child.token_ids)
        token = self.cycle[pos % len(self.cycle)]
        child.token_ids.append(token)
        self.counters["generation_tokens_total"] += 1
        if p.logprobs is not None:
            top = {token: Logprob(-0.5, 1)}
            for r in range(1, p.logprobs + 1):
                alt = self.cycle[(pos + r) % len(self.cycle)]
                top.setdefault(alt, Logprob(-0.5 - r, r + 1))
            child.logprobs.append(top)
        child.text = self.tokenizer.decode(child.token_ids)
        for stop in p.stop:
            at = child.text.find(stop)
            if at >= 0:
                child.text = child.text[: at + (len(stop) if p.include_stop_str_in_output else 0)]
                child.finish_reason, child.stop_reason = "stop", stop
                return
        if len(child.token_ids) >= (p.max_tokens or 10**9):
            child.finish_reason = "length"

    def _output(self, req: _Req) -> RequestOutput | None:
        kind = req.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not req.finished:
            return None
        outs = []
        for c in req.children:
            if kind == RequestOutputKind.DELTA:
                if c.finish_sent:
                    continue
                # Hold back text that may still turn out to be the start of a stop string.
                hold = 0 if c.finish_reason else max([len(x) - 1 for x in req.params.stop] or [0])
                visible = c.text[: max(c.sent_text, len(c.text) - hold)]
                new_ids, new_text = c.token_ids[c.sent_tokens:], visible[c.sent_text:]
                lps = c.logprobs[c.sent_tokens:] if req.params.logprobs is not None else None
                c.sent_tokens, c.sent_text = len(c.token_ids), len(visible)
                c.finish_sent = c.finish_reason is not None
                if not new_ids and not new_text and c.finish_reason is None:
                    continue
            else:
                new_ids, new_text = list(c.token_ids), c.text
                lps = list(c.logprobs) if req.params.logprobs is not None else None
            outs.append(CompletionOutput(c.index, new_text, new_ids, None, lps, c.finish_reason, c.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, None, outs, req.finished, req.metrics)
