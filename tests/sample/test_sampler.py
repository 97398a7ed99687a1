"""Sampler: greedy, temperature, filters, processors (vLLM semantics), logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.sample import SamplerVariant, SamplingInputBuilder, compute_prompt_logprobs, sample_jit
from jaxlm.sample import ops
from jaxlm.sampling_params import SamplingParams

V = 300  # not a multiple of the 128-wide CDF blocks on purpose


def _logits(seed: int, rows: int = 1, scale: float = 2.0) -> np.ndarray:
    return (np.random.RandomState(seed).randn(rows, V) * scale).astype(np.float32)


def _draw(row: np.ndarray, params: dict, n: int = 512, prompt=(1, 2, 3), outputs=()) -> np.ndarray:
    """n independent draws for one logits row: n requests with seeds 0..n-1 in one batch."""
    b = SamplingInputBuilder(V, 64)
    ids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        b.add_request(rid, SamplingParams(seed=i, **params), list(prompt), list(outputs))
    md = b.build(ids, n)
    return np.asarray(sample_jit(jnp.asarray(np.tile(row, (n, 1))), md).sampled_token_ids)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax_and_padding_rows():
    b = SamplingInputBuilder(V, 64)
    for i in range(3):
        b.add_request(f"g{i}", SamplingParams(temperature=0.0), [5])
    md = b.build(["g0", "g1", "g2"], 8)
    assert md.variant == SamplerVariant()
    logits = _logits(0, 8)
    out = np.asarray(sample_jit(jnp.asarray(logits), md).sampled_token_ids)
    np.testing.assert_array_equal(out, logits.argmax(-1))


def test_temperature_sampling_matches_softmax():
    row = _logits(1)[0] * 0.5
    toks = _draw(row, dict(temperature=0.7), n=2048)
    freq = np.bincount(toks, minlength=V) / toks.size
    p = _softmax(row / 0.7)
    # Total variation distance from the target: no worse than numpy's own sampler at this n.
    tv = 0.5 * np.abs(freq - p).sum()
    rs = np.random.RandomState(0)
    ref = [0.5 * np.abs(np.bincount(rs.choice(V, toks.size, p=p / p.sum()), minlength=V) / toks.size - p).sum()
           for _ in range(20)]
    assert tv < 1.2 * max(ref), (tv, ref)
    assert len(set(toks.tolist())) > 20


def test_top_k_never_outside():
    row = _logits(2)[0]
    toks = _draw(row, dict(temperature=1.5, top_k=7))
    allowed = set(np.argsort(-row)[:7].tolist())
    assert set(toks.tolist()) <= allowed
    assert len(set(toks.tolist())) >= 4


def test_top_p_never_outside_nucleus():
    row = _logits(3)[0]
    p = _softmax(row)
    order = np.argsort(-p)
    mass_before = np.cumsum(p[order]) - p[order]
    nucleus = set(order[mass_before < 0.6].tolist())
    toks = _draw(row, dict(temperature=1.0, top_p=0.6))
    assert set(toks.tolist()) <= nucleus
    assert len(set(toks.tolist())) >= min(3, len(nucleus))


def test_min_p_never_below():
    row = _logits(4)[0]
    p = _softmax(row)
    keep = set(np.nonzero(p >= 0.2 * p.max())[0].tolist())
    toks = _draw(row, dict(temperature=1.0, min_p=0.2))
    assert set(toks.tolist()) <= keep


def _vllm_top_k_top_p_keep(x: np.ndarray, k: int, p: float) -> np.ndarray:
    """Reference: vLLM's sort-based masking, written with numpy."""
    order = np.argsort(x, kind="stable")  # ascending
    s = x[order].astype(np.float64)
    if k:
        s = np.where(s < s[len(s) - k], -np.inf, s)
    if p < 1.0:
        e = np.exp(s - s.max())
        cum = np.cumsum(e / e.sum())
        mask = cum <= 1 - p
        mask[-1] = False
        s = np.where(mask, -np.inf, s)
    keep = np.zeros(len(x), bool)
    keep[order] = np.isfinite(s)
    return keep


@pytest.mark.parametrize("num_candidates", [V, 64])
def test_top_k_top_p_threshold_matches_vllm(num_candidates):
    rng = np.random.RandomState(5)
    x = (rng.randn(12, V) * rng.uniform(0.3, 4, (12, 1))).astype(np.float32)
    top_k = np.array([0, 1, 5, 40, 0, 0, 3, 299, 0, 10, 150, 0], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 1.0, 0.5, 0.95, 0.9, 0.3, 0.999, 0.8, 0.99, 1.0], np.float32)
    t = jax.jit(ops.top_k_top_p_threshold, static_argnums=3)(
        jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p), num_candidates)
    got = x >= np.asarray(t)[:, None]
    truncated = 0
    for i in range(12):
        want = _vllm_top_k_top_p_keep(x[i], int(top_k[i]), float(top_p[i]))
        top = np.zeros(V, bool)
        top[np.argsort(-x[i], kind="stable")[:num_candidates]] = True
        if top_k[i] == 0 and top_p[i] == 1.0:
            assert got[i].all()
        elif top_k[i] <= num_candidates and want.sum() <= num_candidates:
            np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")
        elif top_k[i] <= num_candidates:  # nucleus larger than the candidates: cut to them
            truncated += 1
            np.testing.assert_array_equal(got[i], want & top, err_msg=f"row {i}")
        else:  # top_k > candidates: a non-empty subset of vLLM's kept set, within the candidates
            truncated += 1
            assert got[i].any() and not (got[i] & ~(want & top)).any(), f"row {i}"
    assert truncated == (0 if num_candidates == V else truncated) and (num_candidates == V or truncated > 0)


def test_filtered_and_unfiltered_rows_in_one_batch():
    b = SamplingInputBuilder(V, 64)
    b.add_request("k", SamplingParams(temperature=1.0, top_k=1, seed=1), [1])
    b.add_request("g", SamplingParams(temperature=0.0), [1])
    b.add_request("t", SamplingParams(temperature=1.0, seed=2), [1])
    logits = _logits(6, 4)
    out = np.asarray(sample_jit(jnp.asarray(logits), b.build(["k", "g", "t"], 4)).sampled_token_ids)
    assert out[0] == logits[0].argmax() and out[1] == logits[1].argmax()


# ---------------------------------------------------------------- processors


def _processed(params: SamplingParams, logits: np.ndarray, prompt, outputs) -> np.ndarray:
    from jaxlm.sample.sampler import apply_logits_processors

    b = SamplingInputBuilder(V, 64)
    b.add_request("r", params, prompt, outputs)
    md = b.build(["r"], 2)
    assert md.variant.processors
    out = jax.jit(apply_logits_processors)(jnp.asarray(np.tile(logits, (2, 1))), md)
    return np.asarray(out)[0]


def test_penalties_match_vllm_formulas():
    logits = _logits(7)[0]
    prompt, outputs = [3, 4, 4, 10], [10, 11, 11, 11, 4]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    got = _processed(params, logits, prompt, outputs)
    want = logits.copy()
    seen = np.zeros(V, bool)
    seen[prompt + outputs] = True
    counts = np.bincount(outputs, minlength=V).astype(np.float32)
    rep = np.where(seen, np.float32(1.3), np.float32(1.0))
    want = want * np.where(want > 0, 1.0 / rep, rep)
    want = want - 0.25 * counts - 0.5 * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # prompt-only token 3: repetition only; output token 11: all three penalties
    assert got[3] != logits[3] and got[50] == logits[50]


def test_logit_bias_allowed_and_bad_words_and_min_tokens():
    logits = _logits(8)[0]
    p = SamplingParams(logit_bias={5: 3.0, 6: -2.0}, allowed_token_ids=[5, 6, 7, 8, 9],
                       min_tokens=3, stop_token_ids=[9])
    got = _processed(p, logits, [1], [20, 21])
    assert np.isneginf(got[np.setdiff1d(np.arange(V), [5, 6, 7, 8])]).all()  # 9: stop id masked
    np.testing.assert_allclose(got[[5, 6, 7, 8]], logits[[5, 6, 7, 8]] + [3, -2, 0, 0], rtol=1e-6)
    # min_tokens reached: the stop id is allowed again
    got = _processed(p, logits, [1], [20, 21, 22])
    assert np.isfinite(got[9])

    p = SamplingParams(bad_words=["x"])
    p.bad_words_token_ids = [[7], [30, 31], [40, 41, 42]]
    got = _processed(p, logits, [30], [])  # prefix only in the prompt does not count (vLLM)
    assert np.isneginf(got[7]) and np.isfinite(got[31]) and np.isfinite(got[42])
    got = _processed(p, logits, [1], [5, 30])
    assert np.isneginf(got[31]) and np.isfinite(got[42])
    got = _processed(p, logits, [1], [40, 41])
    assert np.isneginf(got[42]) and np.isfinite(got[31])
    assert np.count_nonzero(got != logits) == 2  # 7 and 42 only


def test_greedy_with_processors_and_bans_are_never_sampled():
    row = np.zeros(V, np.float32)
    row[:4] = [5.0, 4.9, 4.8, 4.7]
    toks = _draw(row, dict(temperature=1.0, logit_bias={0: -100.0}, allowed_token_ids=[0, 1, 2, 5]),
                 n=256)
    assert set(toks.tolist()) <= {1, 2, 5}
    toks = _draw(row, dict(temperature=0.0, repetition_penalty=2.0), n=4, prompt=[9], outputs=[0])
    assert (toks == 1).all()


def test_rejects_what_it_cannot_honour():
    b = SamplingInputBuilder(V, 64, max_logprobs=5, max_allowed_tokens=4)
    with pytest.raises(ValueError, match="--max-logprobs"):
        b.check_params(SamplingParams(logprobs=6))
    with pytest.raises(ValueError, match="max_logprobs"):
        b.check_params(SamplingParams(prompt_logprobs=9))
    with pytest.raises(ValueError, match="out-of-vocab"):
        b.check_params(SamplingParams(logit_bias={V: 1.0}))
    with pytest.raises(ValueError, match="out-of-vocab"):
        b.check_params(SamplingParams(allowed_token_ids=[-1]))
    with pytest.raises(ValueError, match="at most"):
        b.check_params(SamplingParams(allowed_token_ids=[1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="tokenized"):
        b.check_params(SamplingParams(bad_words=["x"]))
    assert "a" not in b
    assert len(b.variants()) == 24 and len(set(b.variants())) == 24


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_with_ranks_and_topk_order():
    logits = _logits(9, 2)
    b = SamplingInputBuilder(V, 64, max_logprobs=5)
    b.add_request("a", SamplingParams(temperature=1.0, seed=3, logprobs=5, logit_bias={0: 50.0}), [1])
    b.add_request("b", SamplingParams(temperature=0.0, logprobs=2), [1])
    md = b.build(["a", "b"], 2)
    assert md.variant == SamplerVariant(random=True, processors=True, logprobs=True)
    out = sample_jit(jnp.asarray(logits), md)
    tok = np.asarray(out.sampled_token_ids)
    assert tok[0] == 0  # the +50 bias decides the draw ...
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    ids, lps, ranks = (np.asarray(a) for a in (out.logprob_token_ids, out.logprobs, out.sampled_token_ranks))
    assert ids.shape == (2, 6) and lps.shape == (2, 6)
    for i in range(2):
        assert ids[i, 0] == tok[i]
        np.testing.assert_allclose(lps[i, 0], raw[i, tok[i]], rtol=1e-5)  # ... but logprobs are raw
        np.testing.assert_array_equal(ids[i, 1:], np.argsort(-raw[i], kind="stable")[:5])
        np.testing.assert_allclose(lps[i, 1:], np.sort(raw[i])[::-1][:5], rtol=1e-5)
        assert ranks[i] == 1 + np.sum(raw[i] > raw[i, tok[i]])
    assert ranks[1] == 1


def test_prompt_logprobs():
    logits = _logits(10, 4)
    nxt = np.array([3, 7, 7, 0], np.int32)
    ids, lps, ranks = compute_prompt_logprobs(jnp.asarray(logits), jnp.asarray(nxt), 3)
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    np.testing.assert_array_equal(np.asarray(ids)[:, 0], nxt)
    np.testing.assert_allclose(np.asarray(lps)[:, 0], raw[np.arange(4), nxt], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids)[:, 1:], np.argsort(-raw, -1, kind="stable")[:, :3])
    np.testing.assert_array_equal(np.asarray(ranks), 1 + (raw > raw[np.arange(4), nxt][:, None]).sum(-1))


def test_all_variants_compile_on_dummy_metadata():
    b = SamplingInputBuilder(V, 64)
    logits = jnp.asarray(_logits(11, 4))
    for variant in b.variants():
        out = sample_jit(logits, b.dummy_metadata(4, variant))
        np.testing.assert_array_equal(np.asarray(out.sampled_token_ids), np.asarray(logits).argmax(-1))
        assert (out.logprobs is not None) == variant.logprobs


@pytest.mark.parametrize("k", [1, 20, 256])
def test_fast_top_k_and_argmax_match_lax(k):
    x = np.random.RandomState(k).randn(5, 49152 + 17).astype(np.float32)
    x[2, [10, 5000, 49160]] = 50.0  # tied maxima: the first index wins
    vals, ids = jax.jit(ops.fast_top_k, static_argnums=1)(jnp.asarray(x), k)
    ref_vals, ref_ids = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), 1), np.asarray(ref_vals))
    np.testing.assert_array_equal(np.asarray(jax.jit(ops.fast_argmax)(jnp.asarray(x))), x.argmax(-1))
