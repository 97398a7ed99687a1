"""LogprobsProcessor: vLLM's logprob dicts from the sampler's rows, prompt logprobs, cumulative."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm.core.outputs import LogprobsLists  # noqa: E402
from jaxlm.engine.logprobs import LogprobsProcessor  # noqa: E402
from jaxlm.outputs import Logprob  # noqa: E402
from jaxlm.sample import SamplingInputBuilder, compute_prompt_logprobs, sample_jit  # noqa: E402
from jaxlm.sampling_params import SamplingParams  # noqa: E402
from tests.sample.tok_helpers import byte_fallback_tokenizer  # noqa: E402


def test_sample_logprobs_dicts_and_cumulative():
    tok = byte_fallback_tokenizer()
    # two steps, max_logprobs = 3 columns of top-k after the sampled token
    lists = LogprobsLists(
        token_ids=np.array([[7, 5, 7, 9], [11, 11, 4, 6]]),
        logprobs=np.array([[-1.5, -0.5, -1.5, -2.0], [-0.1, -0.1, -3.0, -4.0]], np.float32),
        ranks=np.array([2, 1]))
    proc = LogprobsProcessor(tok, SamplingParams(logprobs=2))
    proc.update_from_output(lists)
    assert proc.cumulative_logprob == np.float32(-1.5) + np.float32(-0.1)
    first, second = proc.logprobs
    assert list(first) == [7, 5]  # sampled token (also 2nd best), then the top-2
    assert first[7].rank == 2 and first[5].rank == 1
    assert first[7].decoded_token == tok.decode([7])
    assert second == {11: Logprob(np.float32(-0.1).item(), 1, tok.decode([11])),
                      4: Logprob(np.float32(-3.0).item(), 2, tok.decode([4]))}


def test_logprobs_zero_and_absent():
    lists = LogprobsLists(np.array([[3, 1, 2]]), np.array([[-2.0, -0.2, -1.0]]), np.array([3]))
    proc = LogprobsProcessor(None, SamplingParams(logprobs=0))
    proc.update_from_output(lists)
    assert proc.logprobs == [{3: Logprob(-2.0, 3, None)}]
    none = LogprobsProcessor(None, SamplingParams())
    none.update_from_output(lists)
    assert none.logprobs is None and none.cumulative_logprob is None and none.prompt_logprobs is None


def test_prompt_logprobs_end_to_end_with_sampler_rows():
    tok = byte_fallback_tokenizer()
    v = 64
    prompt = [1, 5, 9, 12]
    rs = np.random.RandomState(0)
    logits = rs.randn(len(prompt) - 1, v).astype(np.float32)
    ids, lps, ranks = compute_prompt_logprobs(jnp.asarray(logits), jnp.asarray(prompt[1:]), 3)
    params = SamplingParams(prompt_logprobs=2)
    proc = LogprobsProcessor(tok, params)
    # arrives in two chunks (chunked prefill)
    proc.update_from_output(None, LogprobsLists(np.asarray(ids)[:2], np.asarray(lps)[:2], np.asarray(ranks)[:2]))
    proc.update_from_output(None, LogprobsLists(np.asarray(ids)[2:], np.asarray(lps)[2:], np.asarray(ranks)[2:]))
    pl = proc.prompt_logprobs
    assert pl[0] is None and len(pl) == len(prompt)
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for pos in range(1, len(prompt)):
        d = pl[pos]
        tok_id = prompt[pos]
        assert tok_id in d
        np.testing.assert_allclose(d[tok_id].logprob, raw[pos - 1, tok_id], rtol=1e-5)
        assert d[tok_id].rank == 1 + int((raw[pos - 1] > raw[pos - 1, tok_id]).sum())
        top2 = np.argsort(-raw[pos - 1])[:2]
        assert set(top2.tolist()) <= set(d) and len(d) <= 3
    assert proc.pop_prompt_logprobs() == pl and proc.pop_prompt_logprobs() == []
    assert proc.cumulative_logprob is None


def test_sampler_rows_feed_the_processor():
    v = 128
    b = SamplingInputBuilder(v, 32, max_logprobs=4)
    b.add_request("a", SamplingParams(temperature=0.0, logprobs=1), [1])
    logits = np.random.RandomState(1).randn(2, v).astype(np.float32)
    out = sample_jit(jnp.asarray(logits), b.build(["a"], 2))
    row = LogprobsLists(np.asarray(out.logprob_token_ids)[:1], np.asarray(out.logprobs)[:1],
                        np.asarray(out.sampled_token_ranks)[:1])
    proc = LogprobsProcessor(None, SamplingParams(temperature=0.0, logprobs=1))
    proc.update_from_output(row)
    best = int(logits[0].argmax())
    assert list(proc.logprobs[0]) == [best] and proc.logprobs[0][best].rank == 1
    np.testing.assert_allclose(proc.cumulative_logprob,
                               logits[0, best] - np.log(np.exp(logits[0]).sum()), rtol=1e-5)
