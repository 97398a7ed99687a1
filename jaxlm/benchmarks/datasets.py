"""The prompts of `jaxlm bench serve|throughput`: vLLM's --dataset-name random, sharegpt, custom.

- random: --num-prompts prompts of --random-input-len tokens (each length drawn uniformly within
  +-(--random-range-ratio) of it, as the output lengths around --random-output-len), token ids
  drawn from the tokenizer's vocabulary without its special tokens, decoded to text and
  re-encoded until the text is that many tokens long (as vLLM does, so a server tokenizing the
  text sees the intended length);
- sharegpt: a ShareGPT JSON file; the first human turn is the prompt and the reply's length the
  output length (or --sharegpt-output-len); too short (< 4 tokens) or too long (prompt > 1024,
  total > 2048) conversations are skipped, as vLLM does;
- custom: a JSONL file, one {"prompt": "..."} a line (optionally "output_len"); output length
  --custom-output-len otherwise. A bad line is refused with its line number.
The file readers are those of scripts/bench.py's workloads (jaxlm/benchmarks/workload.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
from typing import Any

import numpy as np

from jaxlm.benchmarks.workload import read_jsonl, read_sharegpt

DATASET_NAMES = ("random", "sharegpt", "custom")


@dataclasses.dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    # Exact token ids where the dataset has them (random): the offline benchmarks feed these.
    prompt_token_ids: list[int] | None = None


def add_dataset_args(parser: argparse.ArgumentParser, *, seed: bool = True) -> None:
    """vLLM's dataset flags (`seed=False` where the engine's --seed is shared, as in vLLM)."""
    g = parser.add_argument_group("dataset", "the prompts (vLLM's flags)")
    g.add_argument("--dataset-name", default="random", choices=DATASET_NAMES, help="where the prompts come from")
    g.add_argument("--dataset-path", default=None, help="the sharegpt JSON or custom JSONL file")
    g.add_argument("--num-prompts", type=int, default=1000, help="number of prompts to process")
    g.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    g.add_argument("--output-len", type=int, default=None,
                   help="sets the output length of every dataset (--random/--sharegpt/--custom-output-len)")
    g.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="random: output tokens")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens of every request (default: the reference reply's)")
    g.add_argument("--custom-output-len", type=int, default=256, help="custom: output tokens where a line has none")
    if seed:
        g.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrival times")


def _check(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be positive, got {args.num_prompts}")
    if args.dataset_name == "random":
        if args.dataset_path is not None:
            raise ValueError("--dataset-name random takes no --dataset-path (use sharegpt or custom for a file)")
        if not 0 <= args.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
        if args.random_input_len < 1 or args.random_output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be positive")
    elif not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    elif not os.path.isfile(args.dataset_path):
        raise ValueError(f"--dataset-path {args.dataset_path}: no such file")


def _lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(np.floor(length * (1 - ratio)))), int(np.ceil(length * (1 + ratio)))
    return rng.integers(lo, hi + 1, n).tolist()


def _text_of_length(tokenizer: Any, ids: list[int], allowed: np.ndarray, rng: np.random.Generator,
                    target: int) -> tuple[str, list[int]]:
    """Decode ids; re-encode; pad with more random ids or cut until the text is `target` tokens."""
    for _ in range(10):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == target:
            return text, again
        ids = again[:target] if len(again) > target else again + rng.choice(allowed, target - len(again)).tolist()
    return text, again


def random_requests(args: argparse.Namespace, tokenizer: Any, seed: int) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([i for i in range(vocab) if i not in special])
    n = args.num_prompts
    out = []
    for n_in, n_out in zip(_lengths(rng, n, args.random_input_len, args.random_range_ratio),
                           _lengths(rng, n, args.random_output_len, args.random_range_ratio)):
        text, ids = _text_of_length(tokenizer, rng.choice(allowed, n_in).tolist(), allowed, rng, n_in)
        out.append(SampleRequest(text, len(ids), n_out, prompt_token_ids=ids))
    return out


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def sharegpt_requests(args: argparse.Namespace, tokenizer: Any, seed: int) -> list[SampleRequest]:
    convs = read_sharegpt(args.dataset_path, 0)
    random.Random(seed).shuffle(convs)
    out = []
    for c in convs:
        n_in = _count(tokenizer, c.prompt)
        n_out = args.sharegpt_output_len or _count(tokenizer, c.reference_output or "")
        fixed = args.sharegpt_output_len is not None
        if n_in < 4 or (not fixed and n_out < 4) or n_in > 1024 or n_in + n_out > 2048:
            continue
        out.append(SampleRequest(c.prompt, n_in, n_out))
        if len(out) == args.num_prompts:
            break
    return out


def custom_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    rows = read_jsonl(args.dataset_path, args.custom_output_len)
    out = []
    for i, r in enumerate(rows[:args.num_prompts]):
        if r.prompt is None:
            raise ValueError(f"{args.dataset_path}: request {i + 1} has no 'prompt' text (the custom dataset sends text)")
        n_out = args.output_len or r.output_len
        out.append(SampleRequest(r.prompt, _count(tokenizer, r.prompt), n_out, prompt_token_ids=r.prompt_token_ids))
    return out


def get_samples(args: argparse.Namespace, tokenizer: Any, seed: int) -> list[SampleRequest]:
    """The requests --dataset-name asks for (ValueError with the reason when it cannot)."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
    _check(args)
    if args.dataset_name == "random":
        reqs = random_requests(args, tokenizer, seed)
    elif args.dataset_name == "sharegpt":
        reqs = sharegpt_requests(args, tokenizer, seed)
    else:
        reqs = custom_requests(args, tokenizer)
    if not reqs:
        raise ValueError(f"{args.dataset_path}: no usable request")
    return reqs
