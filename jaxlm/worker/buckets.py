"""Bucket lists: every step is padded up to one of a few fixed sizes so XLA compiles a known set."""

from __future__ import annotations

import bisect


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """[start, 2*start, ..., first power >= limit] (the last bucket always holds `limit`)."""
    buckets = [start]
    while buckets[-1] < limit:
        buckets.append(buckets[-1] * 2)
    return buckets


def validate_buckets(buckets: list[int], must_hold: int, what: str) -> list[int]:
    buckets = sorted(set(int(b) for b in buckets))
    if not buckets or buckets[0] <= 0:
        raise ValueError(f"{what} buckets must be positive integers, got {buckets}")
    if buckets[-1] < must_hold:
        raise ValueError(f"the largest {what} bucket ({buckets[-1]}) is below {must_hold}")
    return buckets


def pick_bucket(n: int, buckets: list[int]) -> int:
    """Smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def default_seq_buckets(max_num_seqs: int) -> list[int]:
    """Powers of 4: sampling a padded row is cheap next to compiling another program."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] * 4)
    return buckets


def default_token_buckets(budget: int) -> list[int]:
    """Powers of 2 up to the step budget. Measured against powers of 4 over decode sizes
    (`scripts/bench.py --bucket-configs`): 6 more programs, but padding waste 0.8% vs 26% and
    +16% output tok/s on a mixed workload; the compile cache makes the extra programs a
    one-time cost."""
    return powers_of_two_up_to(budget)


def decode_buckets(token_buckets: list[int], max_num_seqs: int) -> list[int]:
    """The token buckets a decode-only step (one token per request) can land in: those up to
    the first one that holds max_num_seqs tokens."""
    limit = pick_bucket(min(max_num_seqs, token_buckets[-1]), token_buckets)
    return [t for t in token_buckets if t <= limit]


def prompt_logprobs_buckets(token_buckets: list[int]) -> list[int]:
    """Every other token bucket, counting down from the largest (which is always kept).

    A prompt-logprobs body compiles the whole model again; steps that need one are rare
    (scoring, echo), so they pad to at most ~4x instead of ~2x. Measured on the tiny Llama at
    the default 10 token buckets, compile cache off, 2 shared CPU cores: warm-up 20-22 s wall
    with a separate logits-only prompt-logprobs program, 33 s with a prompt-logprobs body per
    token bucket; with every other bucket, LLM() start-up costs 27.5-28.3 CPU-s against
    24.4 before (35 programs against 40).
    """
    return token_buckets[::-1][::2][::-1]
