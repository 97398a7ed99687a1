"""N-gram prompt lookup on the host (vLLM's ngram method), vectorised over the batch.

For each request: the longest suffix of n tokens (prompt_lookup_min <= n <= prompt_lookup_max)
that also occurs earlier in its tokens (prompt and output), at its earliest occurrence (vLLM's
rule); the k tokens that followed that occurrence are the drafts (fewer when the context ends
sooner, none without a match).

All requests at once, as [R, L] boolean arrays over the runner's persistent token rows: match[n]
marks the end positions e where the n tokens ending at e equal the last n tokens, built from
match[n - 1] with one comparison per n (no Python loop over tokens); the loop over n stops as
soon as no row has a match that long.
"""

from __future__ import annotations

import numpy as np

from jaxlm.config.speculative import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """token_ids [R, >= max(num_tokens)]: each request's tokens (row r valid up to
        num_tokens[r]); the drafts of each row."""
        R = len(num_tokens)
        if R == 0:
            return []
        L = int(num_tokens.max())
        tok = token_ids[:, :L]
        rows = np.arange(R)
        cols = np.arange(L)
        # A match must end at e <= L_r - 2: it is not the suffix itself and a token follows it.
        match = (tok == tok[rows, np.maximum(num_tokens - 1, 0)][:, None]) & (cols[None, :] <= num_tokens[:, None] - 2)
        best_end = np.full(R, -1, np.int64)
        for n in range(1, min(self.max_n, L - 1) + 1):
            if n > 1:
                # The n-gram ending at e: the (n-1)-gram ending at e, and one more token before it.
                prev = np.zeros_like(match)
                prev[:, n - 1:] = tok[:, :L - n + 1] == tok[rows, np.maximum(num_tokens - n, 0)][:, None]
                match &= prev
            found = match.any(axis=1)
            if not found.any():
                break
            if n >= self.min_n:  # longer wins: overwrite with this n's earliest end
                best_end = np.where(found, match.argmax(axis=1), best_end)
        start = best_end + 1
        room = np.minimum(num_tokens - start, self.max_model_len - num_tokens)
        count = np.where(best_end >= 0, np.clip(room, 0, self.k), 0)
        return [tok[r, start[r]:start[r] + count[r]].tolist() if count[r] else [] for r in range(R)]
