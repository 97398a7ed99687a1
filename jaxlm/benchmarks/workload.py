"""Benchmark workloads: synthetic length distributions, a JSONL of prompts, a ShareGPT file.

A workload is a list of requests (prompt text or token ids, output length, arrival time). Text
prompts are turned into token ids with `Workload.tokenized(tokenizer)`; the bucket planner and
the benchmark only use token ids. Specs, as `scripts/bench.py --workload` takes them:

    synthetic[:num=128,prompt=16-1024,output=16-256,seed=0]   uniform lengths, random token ids
    prompts.jsonl     one {"prompt": str | "prompt_token_ids": [int], "output_len"|"max_tokens": int} a line
    sharegpt.json     [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_SYNTHETIC_DEFAULTS = {"num": "128", "prompt": "16-1024", "output": "16-256", "seed": "0"}
_HUMAN, _ASSISTANT = ("human", "user"), ("gpt", "assistant", "chatgpt", "bard")


@dataclasses.dataclass
class WorkloadRequest:
    output_len: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # Seconds after the start of the run (0 for all: the offline case).
    arrival_time: float = 0.0
    # ShareGPT: the reference reply, whose token count becomes output_len once tokenized.
    reference_output: str | None = None


@dataclasses.dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]

    def tokenized(self, tokenizer: Any) -> "Workload":
        """Token ids for every text prompt (and ShareGPT reply lengths) with this tokenizer."""
        out = []
        for r in self.requests:
            ids = r.prompt_token_ids
            if ids is None:
                if tokenizer is None:
                    raise ValueError(f"workload {self.name!r} has text prompts: a tokenizer is needed")
                ids = list(tokenizer.encode(r.prompt))
            n_out = r.output_len
            if r.reference_output is not None and tokenizer is not None:
                n_out = max(1, len(tokenizer.encode(r.reference_output, add_special_tokens=False)))
            out.append(dataclasses.replace(r, prompt_token_ids=ids, output_len=n_out))
        return Workload(self.name, out)

    def with_request_rate(self, rate: float, seed: int = 0) -> "Workload":
        """Poisson arrivals at `rate` requests/s (inf: all at once)."""
        if rate <= 0:
            raise ValueError(f"the request rate must be positive, got {rate}")
        if np.isinf(rate):
            times = np.zeros(len(self.requests))
        else:
            times = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(self.requests)))
        return Workload(self.name, [dataclasses.replace(r, arrival_time=float(t))
                                    for r, t in zip(self.requests, times)])

    def fitting(self, max_model_len: int) -> "Workload":
        """Drops requests whose prompt + output exceed max_model_len (logged)."""
        keep = [r for r in self.requests if len(r.prompt_token_ids) + r.output_len <= max_model_len]
        if len(keep) < len(self.requests):
            logger.warning("workload %s: dropped %d of %d requests longer than max_model_len=%d",
                           self.name, len(self.requests) - len(keep), len(self.requests), max_model_len)
        if not keep:
            raise ValueError(f"workload {self.name!r}: no request fits in max_model_len={max_model_len}")
        return Workload(self.name, keep)

    def max_total_len(self) -> int:
        return max(len(r.prompt_token_ids) + r.output_len for r in self.requests)


def _range(text: str, what: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"synthetic {what}={text!r}: expected LO-HI or N") from None
    if not 0 < lo_n <= hi_n:
        raise ValueError(f"synthetic {what}={text!r}: need 0 < LO <= HI")
    return lo_n, hi_n


def synthetic_workload(num: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                       vocab_size: int, seed: int = 0) -> Workload:
    """Lengths uniform in the inclusive ranges; random token ids away from the special ones."""
    if num <= 0:
        raise ValueError(f"synthetic num must be positive, got {num}")
    rng = np.random.default_rng(seed)
    lo_id, hi_id = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size // 2)
    reqs = []
    for _ in range(num):
        n_in = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        n_out = int(rng.integers(output_len[0], output_len[1] + 1))
        reqs.append(WorkloadRequest(n_out, prompt_token_ids=rng.integers(lo_id, hi_id, n_in).tolist()))
    name = f"synthetic:num={num},prompt={prompt_len[0]}-{prompt_len[1]},output={output_len[0]}-{output_len[1]}"
    return Workload(name, reqs)


def synthetic_spec_within(max_model_len: int) -> str:
    """The default synthetic workload's spec with its prompt and output ranges scaled down
    together so that every request fits in max_model_len tokens (prompt + output)."""
    (p_lo, p_hi), (o_lo, o_hi) = (_range(_SYNTHETIC_DEFAULTS[k], k) for k in ("prompt", "output"))
    if max_model_len < p_lo + o_lo:
        raise ValueError(f"max_model_len={max_model_len} holds no request of the synthetic workload "
                         f"(at least {p_lo + o_lo} tokens)")
    scale = min(1.0, max_model_len / (p_hi + o_hi))
    o_hi = max(o_lo, int(o_hi * scale))
    p_hi = max(p_lo, min(int(p_hi * scale), max_model_len - o_hi))
    return f"synthetic:prompt={p_lo}-{p_hi},output={o_lo}-{o_hi}"


def read_jsonl(path: str, default_output_len: int) -> list[WorkloadRequest]:
    reqs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            reqs.append(_jsonl_request(rec, default_output_len, f"{path}:{n}"))
    return reqs


def _jsonl_request(rec: Any, default_output_len: int, where: str) -> WorkloadRequest:
    """One line of a prompts file, checked (ValueError naming file and line)."""
    if not isinstance(rec, dict) or ("prompt" not in rec and "prompt_token_ids" not in rec):
        raise ValueError(f"{where}: expected an object with 'prompt' or 'prompt_token_ids'")
    prompt, ids = rec.get("prompt"), rec.get("prompt_token_ids")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids)):
        raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
    out_len = rec.get("output_len", rec.get("max_tokens", default_output_len))
    if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 1:
        raise ValueError(f"{where}: 'output_len' must be a positive integer, got {out_len!r}")
    return WorkloadRequest(out_len, prompt=prompt, prompt_token_ids=ids)


def read_sharegpt(path: str, default_output_len: int) -> list[WorkloadRequest]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}")
    reqs = []
    for conv in data:
        turns = (conv.get("conversations") or []) if isinstance(conv, dict) else []
        # The first human turn is the prompt; the reply after it sets the output length.
        for a, b in zip(turns, turns[1:]):
            if a.get("from") in _HUMAN and b.get("from") in _ASSISTANT:
                reqs.append(WorkloadRequest(default_output_len, prompt=a["value"], reference_output=b["value"]))
                break
    return reqs


def load_workload(spec: str, vocab_size: int, default_output_len: int = 128,
                  num: int | None = None) -> Workload:
    """A workload from its spec (see the module docstring); `num` keeps the first num requests."""
    if spec == "synthetic" or spec.startswith("synthetic:"):
        opts = dict(_SYNTHETIC_DEFAULTS)
        for item in filter(None, spec.partition(":")[2].split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in opts:
                raise ValueError(f"synthetic workload option {item!r}: use {', '.join(opts)} as key=value")
            opts[key] = value
        return synthetic_workload(int(num or opts["num"]), _range(opts["prompt"], "prompt"),
                                  _range(opts["output"], "output"), vocab_size, int(opts["seed"]))
    if not os.path.isfile(spec):
        raise ValueError(f"workload {spec!r}: not 'synthetic[:...]' nor a file")
    reqs = read_jsonl(spec, default_output_len) if spec.endswith(".jsonl") else read_sharegpt(spec, default_output_len)
    if not reqs:
        raise ValueError(f"workload {spec!r} holds no usable request")
    return Workload(os.path.basename(spec), reqs[:num] if num else reqs)
