"""What the executor returns to the core, and what the core returns to the engine."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterator

import numpy as np

_EMPTY = np.zeros(0, np.int32)


@dataclasses.dataclass
class LogprobsLists:
    """Top-k logprobs: row i of a step's logprobs belongs to ModelRunnerOutput.req_ids[i].

    token_ids[i] / logprobs[i] hold the sampled token first, then the top-k; ranks[i] is the
    sampled token's rank (1 = most likely) in the unfiltered distribution.
    """

    token_ids: np.ndarray  # [N, 1 + k] int
    logprobs: np.ndarray  # [N, 1 + k] float
    ranks: np.ndarray  # [N] int


@dataclasses.dataclass
class ModelRunnerOutput:
    # Requests of the step, in the runner's order, and each one's index in that order.
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Tokens sampled this step, back to back in req_ids order: num_sampled[i] of them for
    # request i (0 while its prompt is being prefilled; 1 + accepted drafts under speculative
    # decoding). Arrays, so the scheduler takes a step's tokens without a loop per request.
    num_sampled: np.ndarray  # [len(req_ids)] int32
    sampled_flat: np.ndarray  # [num_sampled.sum()] int32
    # One row per sampled token (sampled_flat's order), or None when no row asked for logprobs.
    logprobs: LogprobsLists | None = None
    # req_id -> prompt logprobs of the positions computed this step (same layout as logprobs).
    prompt_logprobs: dict[str, LogprobsLists] = dataclasses.field(default_factory=dict)
    # req_id -> why that request's host-side work failed this step: it finishes with an error
    # alone (FinishReason.ERROR) while the rest of the batch goes on.
    failed_req_ids: dict[str, str] = dataclasses.field(default_factory=dict)
    # Requests whose structured-output grammar accepts nothing more after this step's token:
    # the scheduler finishes them with "stop" (before ignore_eos, min_tokens and the length cap).
    grammar_terminated_req_ids: set[str] = dataclasses.field(default_factory=set)
    # Speculative decoding: per request (req_ids order), the tokens drafted for its next step
    # (None when the runner proposed nothing).
    spec_token_ids: list[list[int]] | None = None

    @classmethod
    def from_lists(cls, req_ids: list[str], sampled_token_ids: list[list[int]], **kwargs) -> "ModelRunnerOutput":
        """From vLLM's per-request token lists (stand-in runners, tests)."""
        num = np.fromiter(map(len, sampled_token_ids), np.int32, len(sampled_token_ids))
        flat = np.fromiter(itertools.chain.from_iterable(sampled_token_ids), np.int32, int(num.sum()))
        return cls(req_ids, dict(zip(req_ids, range(len(req_ids)))), num, flat, **kwargs)

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls(req_ids=[], req_id_to_index={}, num_sampled=_EMPTY, sampled_flat=_EMPTY)

    @property
    def sampled_token_ids(self) -> list[list[int]]:
        """vLLM's per-request lists (built on each read: for tests and tools, not the step)."""
        ends = np.cumsum(self.num_sampled).tolist()
        flat = self.sampled_flat.tolist()
        return [flat[e - n:e] for e, n in zip(ends, self.num_sampled.tolist())]


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # failed inside the engine (vLLM's name); the engine goes on

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request (vLLM's stop_reason), else None.
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    # When the core first scheduled the request (time.time()); vLLM's SCHEDULED event.
    scheduled_ts: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class EngineCoreOutputBatch:
    """One step's EngineCoreOutputs, columnar: what the scheduler hands the front end.

    The requests that got tokens, finished or got prompt logprobs (req_ids), their new tokens
    back to back (num_new_tokens[i] for request i, possibly several: speculative decoding), and
    the rest keyed by position in req_ids, present only where it applies. Built and read with
    array operations, not one object per request per step; iterating yields per-request
    EngineCoreOutput views (tests and tools).
    """

    req_ids: list[str] = dataclasses.field(default_factory=list)
    num_new_tokens: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY)  # [n] int32
    new_token_ids: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY)  # [sum] int32
    # One row per new token (new_token_ids' order), when the step computed logprobs.
    new_logprobs: LogprobsLists | None = None
    finish_reasons: dict[int, FinishReason] = dataclasses.field(default_factory=dict)
    stop_reasons: dict[int, int | str] = dataclasses.field(default_factory=dict)
    new_prompt_logprobs: dict[int, LogprobsLists] = dataclasses.field(default_factory=dict)
    # With a request's first tokens (and any output without tokens): prefix-cache hit length
    # and when the core first scheduled it (time.time(), vLLM's SCHEDULED event).
    num_cached_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    scheduled_ts: dict[int, float] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.req_ids)

    def token_offsets(self) -> np.ndarray:
        """[n + 1]: request i's tokens are new_token_ids[offsets[i]:offsets[i + 1]]."""
        offsets = np.zeros(len(self.req_ids) + 1, np.int64)
        np.cumsum(self.num_new_tokens, out=offsets[1:])
        return offsets

    def __getitem__(self, i: int) -> EngineCoreOutput:
        return list(self)[i]

    def finished_req_ids(self) -> list[str]:
        return [self.req_ids[i] for i in self.finish_reasons]

    def __iter__(self) -> Iterator[EngineCoreOutput]:
        offsets = self.token_offsets().tolist()
        tokens = self.new_token_ids.tolist()
        lp = self.new_logprobs
        for i, req_id in enumerate(self.req_ids):
            lo, hi = offsets[i], offsets[i + 1]
            yield EngineCoreOutput(
                req_id=req_id, new_token_ids=tokens[lo:hi], finish_reason=self.finish_reasons.get(i),
                stop_reason=self.stop_reasons.get(i),
                new_logprobs=None if lp is None or lo == hi else slice_logprobs(lp, lo, hi),
                new_prompt_logprobs=self.new_prompt_logprobs.get(i),
                num_cached_tokens=self.num_cached_tokens.get(i, 0), scheduled_ts=self.scheduled_ts.get(i))

    @classmethod
    def from_outputs(cls, outputs: list[EngineCoreOutput]) -> "EngineCoreOutputBatch":
        """From per-request outputs (requests finished outside a step, tests)."""
        num = np.fromiter((len(o.new_token_ids) for o in outputs), np.int32, len(outputs))
        flat = np.fromiter(itertools.chain.from_iterable(o.new_token_ids for o in outputs), np.int32, int(num.sum()))
        rows = [o.new_logprobs for o in outputs if o.new_token_ids]
        lp = None
        if rows and all(r is not None for r in rows):
            lp = LogprobsLists(*(np.concatenate([getattr(r, f) for r in rows])
                                 for f in ("token_ids", "logprobs", "ranks")))
        pick = lambda f: {i: getattr(o, f) for i, o in enumerate(outputs) if getattr(o, f) is not None}  # noqa: E731
        return cls([o.req_id for o in outputs], num, flat, lp, pick("finish_reason"), pick("stop_reason"),
                   pick("new_prompt_logprobs"), {i: o.num_cached_tokens for i, o in enumerate(outputs)},
                   pick("scheduled_ts"))


    @classmethod
    def concat(cls, batches: list["EngineCoreOutputBatch"]) -> "EngineCoreOutputBatch":
        """Several steps' outputs as one, in order (an async engine step may complete two)."""
        if len(batches) == 1:
            return batches[0]
        out, base = cls(), 0
        lps = [b.new_logprobs for b in batches if len(b.new_token_ids)]
        for b in batches:
            out.req_ids += b.req_ids
            for mine, theirs in ((out.finish_reasons, b.finish_reasons), (out.stop_reasons, b.stop_reasons),
                                 (out.new_prompt_logprobs, b.new_prompt_logprobs),
                                 (out.num_cached_tokens, b.num_cached_tokens), (out.scheduled_ts, b.scheduled_ts)):
                mine.update((base + i, v) for i, v in theirs.items())
            base += len(b.req_ids)
        out.num_new_tokens = np.concatenate([b.num_new_tokens for b in batches]).astype(np.int32)
        out.new_token_ids = np.concatenate([b.new_token_ids for b in batches]).astype(np.int32)
        like = next((lp for lp in lps if lp is not None), None)
        if like is not None:  # a step without logprobs gets zero rows (no request of it wants them)
            rows = [b.new_logprobs if b.new_logprobs is not None else _zero_rows(like, len(b.new_token_ids))
                    for b in batches if len(b.new_token_ids)]
            out.new_logprobs = LogprobsLists(*(np.concatenate([getattr(lp, f) for lp in rows])
                                               for f in ("token_ids", "logprobs", "ranks")))
        return out


def _zero_rows(like: LogprobsLists, n: int) -> LogprobsLists:
    return LogprobsLists(*(np.zeros((n,) + a.shape[1:], a.dtype) for a in (like.token_ids, like.logprobs, like.ranks)))


def slice_logprobs(lp: LogprobsLists, start: int, stop: int) -> LogprobsLists:
    return LogprobsLists(token_ids=lp.token_ids[start:stop], logprobs=lp.logprobs[start:stop],
                         ranks=lp.ranks[start:stop])
