"""SamplingParams additions: greedy normalization, stop ids from generation config, bad words."""

from __future__ import annotations

import numpy as np
import pytest

from jaxlm.sampling_params import SamplingParams
from tests.sample.tok_helpers import smollm2_tokenizer


def test_greedy_resets_filters_and_stop_ids_seed_all_stop_ids():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2, stop_token_ids=[7])
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    assert p.all_stop_token_ids == {7}
    assert p.clone().all_stop_token_ids == {7} and p.clone().all_stop_token_ids is not p.all_stop_token_ids


def test_update_from_generation_config():
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config({"eos_token_id": [2, 9]}, model_eos_token_id=2)
    assert p.all_stop_token_ids == {2, 5, 9} and p.stop_token_ids == [5, 9]
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 9}, model_eos_token_id=2)
    assert q.all_stop_token_ids == {2, 9} and q.stop_token_ids == []  # still masked by min_tokens


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_bad_words_tokenized_with_and_without_leading_space():
    tok = smollm2_tokenizer()
    p = SamplingParams(bad_words=["hello", "big house"])
    p.update_from_tokenizer(tok)
    words = p.bad_words_token_ids
    assert tok.encode("hello", add_special_tokens=False) in words
    assert tok.encode(" hello", add_special_tokens=False) in words
    assert tok.encode("big house", add_special_tokens=False) in words
    assert all(isinstance(t, int) for w in words for t in w)


def test_to_host_layout():
    import jax.numpy as jnp

    from jaxlm.sample import SamplingInputBuilder, sample_jit, to_host

    b = SamplingInputBuilder(64, 16, max_logprobs=3)
    b.add_request("a", SamplingParams(temperature=0.0, logprobs=3), [1])
    logits = np.random.RandomState(0).randn(4, 64).astype(np.float32)
    ids, lp = to_host(sample_jit(jnp.asarray(logits), b.build(["a"], 4)), 1)
    assert ids.tolist() == [int(logits[0].argmax())]
    assert lp.token_ids.shape == (1, 4) and lp.logprobs.shape == (1, 4) and lp.ranks.tolist() == [1]


def test_greedy_row_ties_in_a_random_batch_pick_the_first_max():
    import jax.numpy as jnp

    from jaxlm.sample import SamplingInputBuilder, sample_jit

    b = SamplingInputBuilder(64, 16)
    b.add_request("g", SamplingParams(temperature=0.0), [1])
    b.add_request("t", SamplingParams(temperature=1.0, seed=0), [1])
    logits = np.zeros((2, 64), np.float32)
    logits[0, [40, 7, 30]] = 3.0  # three-way tie: argmax is 7
    out = sample_jit(jnp.asarray(logits), b.build(["g", "t"], 2))
    assert int(out.sampled_token_ids[0]) == 7
