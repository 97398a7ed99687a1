"""Bucket lists: every step is padded up to one of a few fixed sizes so XLA compiles a known set."""

from __future__ import annotations

import bisect
import dataclasses


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


def default_seq_buckets(max_num_seqs: int, max_rows: int | None = None) -> list[int]:
    """Powers of 4: sampling a padded row is cheap next to compiling another program. A
    speculative engine samples up to max_rows (> max_num_seqs) rows: one bucket more, that size."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] * 4)
    if max_rows is not None and max_rows > buckets[-1]:
        buckets.append(max_rows)
    return buckets


def default_token_buckets(budget: int, verify_tokens: int | None = None) -> list[int]:
    """Powers of 2 up to the step budget. Measured against powers of 4 over decode sizes
    (`scripts/bench.py --buckets pow2 1,4,16,64,128,256,512`): 6 more programs, but padding
    waste 0.8% vs 26% and +16% output tok/s on a mixed workload; the compile cache makes the
    extra programs a one-time cost. `auto` (jaxlm/worker/bucket_planner.py) fits them to a workload.
    verify_tokens (speculative decoding: 1 + k, one request's verify step) is a bucket too: on
    SmolLM2 at batch 1 a 5-token body took 85 ms against 90 for 8 (min of 15, busy host)."""
    buckets = powers_of_two_up_to(budget)
    if verify_tokens is not None and verify_tokens <= budget:
        buckets = sorted(set(buckets) | {verify_tokens})
    return buckets


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


@dataclasses.dataclass
class PaddingStats:
    """Real vs computed (padded) sizes summed over steps: tokens of the body program, its request
    rows, the page slots of its block table and the sampler's rows (scripts/bench.py reports it)."""

    real_tokens: int = 0
    tokens: int = 0
    real_rows: int = 0
    rows: int = 0
    real_pages: int = 0
    pages: int = 0
    real_samples: int = 0
    samples: int = 0

    def record(self, real_tokens: int, T: int, real_rows: int, R: int, real_pages: int, P: int) -> None:
        """One body step: T tokens and R rows of P page slots computed for the real ones."""
        if real_tokens > T or real_rows > R or real_pages > P:
            raise ValueError(f"real sizes exceed the padded ones: tokens {real_tokens}/{T}, "
                             f"rows {real_rows}/{R}, pages {real_pages}/{P}")
        self.real_tokens += real_tokens
        self.tokens += T
        self.real_rows += real_rows
        self.rows += R
        self.real_pages += real_pages
        self.pages += P

    def record_samples(self, real_samples: int, S: int) -> None:
        if real_samples > S:
            raise ValueError(f"{real_samples} sampled rows exceed the sequence bucket {S}")
        self.real_samples += real_samples
        self.samples += S

    def waste(self) -> dict[str, float]:
        """Fraction of each computed quantity that was padding (0 when nothing ran)."""
        pairs = {"tokens": (self.real_tokens, self.tokens), "rows": (self.real_rows, self.rows),
                 "pages": (self.real_pages, self.pages), "samples": (self.real_samples, self.samples)}
        return {k: 1.0 - real / total if total else 0.0 for k, (real, total) in pairs.items()}
