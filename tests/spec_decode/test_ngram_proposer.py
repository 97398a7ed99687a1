"""The vectorised n-gram lookup against a plain loop over each request's tokens (vLLM's rule:
the longest suffix n-gram within [min, max] found earlier, its earliest occurrence, the k
tokens after it)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxlm.config import SpeculativeConfig
from jaxlm.spec_decode.ngram_proposer import NgramProposer


def reference(tokens: list[int], lo: int, hi: int, k: int, max_model_len: int) -> list[int]:
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - n:]
        for start in range(0, L - n):  # earliest occurrence that is not the suffix itself
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + min(k, max_model_len - L)]
                return follow
    return []


def _batch(seqs: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    tok = np.full((len(seqs), width), -7, np.int32)  # garbage past each row's end
    for i, s in enumerate(seqs):
        tok[i, :len(s)] = s
    return tok, np.array([len(s) for s in seqs], np.int32)


@pytest.mark.parametrize("lo,hi,k", [(1, 1, 3), (1, 3, 4), (2, 5, 5), (3, 3, 1), (5, 5, 4)])
def test_matches_the_loop(lo, hi, k):
    rng = np.random.default_rng(lo * 100 + hi * 10 + k)
    seqs = []
    for _ in range(60):
        n = int(rng.integers(1, 80))
        alphabet = int(rng.integers(2, 12))  # small alphabets: many repeats and nested matches
        seqs.append(rng.integers(0, alphabet, n).tolist())
    seqs += [[], [4], [4, 4], [1, 2, 3, 1, 2, 3, 1, 2]]  # edge cases (an empty row proposes nothing)
    seqs = [s for s in seqs if s]
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo,
                                               prompt_lookup_max=hi), max_model_len=90)
    tok, num = _batch(seqs, 100)
    got = proposer.propose(tok, num)
    assert got == [reference(s, lo, hi, k, 90) for s in seqs]
    assert any(got) and not all(got)


def test_copy_task_and_limits():
    para = list(range(10, 40))
    prompt = [1, 2] + para + [3]
    out = para[:6]  # the model has copied 6 tokens: the lookup proposes the next ones
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                               prompt_lookup_max=4), max_model_len=128)
    tok, num = _batch([prompt + out], 64)
    assert proposer.propose(tok, num) == [para[6:10]]
    # Near max_model_len only what still fits is proposed.
    tight = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                            prompt_lookup_max=4), max_model_len=len(prompt) + len(out) + 2)
    assert tight.propose(tok, num) == [para[6:8]]
    assert proposer.propose(np.zeros((0, 4), np.int32), np.zeros(0, np.int32)) == []
