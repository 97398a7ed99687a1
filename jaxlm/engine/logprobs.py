"""LogprobsProcessor: LogprobsLists rows from the runner -> vLLM's per-position logprob dicts."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxlm.core.outputs import LogprobsLists
from jaxlm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from jaxlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class TokenDecoder:
    """token id -> text of that token alone (vLLM's decoded_token), cached: the vocab is finite."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_ids: Sequence[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(token_ids)
        out: list[str | None] = []
        for t in token_ids:
            s = self._cache.get(t)
            if s is None:
                s = self.tokenizer.decode([t]) or ""
                self._cache[t] = s
            out.append(s)
        return out


def make_logprob_dict(logprobs: Sequence[float], token_ids: Sequence[int],
                      decoded: Sequence[str | None], rank: int, num_logprobs: int) -> dict[int, Logprob]:
    """{token: Logprob} for one position: the chosen token (with its rank) and the top-N.

    The chosen token is first; if it is also in the top-N its entry is simply written twice.
    """
    ranks = itertools.chain((rank,), range(1, num_logprobs + 1))
    n = 1 + num_logprobs
    return {int(tid): Logprob(logprob=float(lp), rank=int(rk), decoded_token=tok)
            for tid, lp, rk, tok in zip(token_ids[:n], logprobs[:n], ranks, decoded[:n])}


class LogprobsProcessor:
    """Per-request logprobs state, fed with the rows of each EngineCoreOutput.

    logprobs / cumulative_logprob are None unless SamplingParams.logprobs is set;
    prompt_logprobs is None unless SamplingParams.prompt_logprobs is set, and then starts with
    None for the first prompt token (nothing predicts it).
    """

    def __init__(self, tokenizer: Any, params: SamplingParams,
                 token_decoder: TokenDecoder | None = None) -> None:
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.decode = token_decoder or TokenDecoder(tokenizer)
        self.logprobs: SampleLogprobs | None = [] if self.num_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if self.num_logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if self.num_prompt_logprobs is not None else None)
        self._prompt_logprobs_sent = 0

    def update_from_output(self, new_logprobs: LogprobsLists | None,
                           new_prompt_logprobs: LogprobsLists | None = None) -> None:
        if new_logprobs is not None and self.logprobs is not None:
            self._update_sample_logprobs(new_logprobs)
        if new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self._update_prompt_logprobs(new_prompt_logprobs)

    def _rows(self, lists: LogprobsLists, n: int):
        ids = np.asarray(lists.token_ids)[:, :1 + n].tolist()
        lps = np.asarray(lists.logprobs)[:, :1 + n].tolist()
        ranks = np.asarray(lists.ranks).reshape(-1).tolist()
        return ids, lps, ranks

    def _update_sample_logprobs(self, lists: LogprobsLists) -> None:
        n = self.num_logprobs
        for ids, lps, rank in zip(*self._rows(lists, n)):
            self.cumulative_logprob += lps[0]  # the sampled token comes first
            self.logprobs.append(make_logprob_dict(lps, ids, self.decode(ids), rank, n))

    def _update_prompt_logprobs(self, lists: LogprobsLists) -> None:
        n = self.num_prompt_logprobs
        for ids, lps, rank in zip(*self._rows(lists, n)):
            self.prompt_logprobs.append(make_logprob_dict(lps, ids, self.decode(ids), rank, n))

    def truncate(self, num_tokens: int) -> None:
        """Keep the first num_tokens positions (tokens past a stop string are dropped); the
        cumulative logprob is summed again in order, as it was built."""
        if self.logprobs is None or len(self.logprobs) <= num_tokens:
            return
        del self.logprobs[num_tokens:]
        self.cumulative_logprob = 0.0
        for position in self.logprobs:
            self.cumulative_logprob += next(iter(position.values())).logprob  # the sampled token's

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """Prompt logprobs not handed out yet (delta outputs send them once)."""
        if self.prompt_logprobs is None:
            return None
        out = self.prompt_logprobs[self._prompt_logprobs_sent:]
        self._prompt_logprobs_sent = len(self.prompt_logprobs)
        return out
