"""SamplingInputBuilder: nothing a request carries can make it raise inside a step, and the
variant is the cheapest compiled one that covers the batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.sample import SERVING_VARIANTS, SamplerVariant, SamplingInputBuilder, covering_variant, sample_jit
from jaxlm.sampling_params import SamplingParams

V = 300


def _sample(b: SamplingInputBuilder, req_ids: list[str], logits: np.ndarray) -> np.ndarray:
    return np.asarray(sample_jit(jnp.asarray(logits), b.build(req_ids, len(req_ids))).sampled_token_ids)


def test_lone_surrogate_request_id_hashes():
    b = SamplingInputBuilder(V, 64)
    # A legal JSON escape that str.encode() refuses: it must not kill the step.
    b.add_request("\ud800", SamplingParams(temperature=1.0), [1])
    b.add_request("\ud800x", SamplingParams(temperature=1.0), [1])
    md = b.build_host(["\ud800", "\ud800x"], 2)
    u = md.fields["uniform"]
    assert 0 < u[0] <= 1 and u[0] != u[1]
    # Same id, same stream: a fresh builder draws the same uniform.
    b2 = SamplingInputBuilder(V, 64)
    b2.add_request("\ud800", SamplingParams(temperature=1.0), [1])
    assert b2.build_host(["\ud800"], 1).fields["uniform"][0] == u[0]


@pytest.mark.parametrize("top_k", [2**31, 2**64, 10**30, V, V + 1])
def test_top_k_beyond_vocab_is_off_and_never_wraps(top_k):
    b = SamplingInputBuilder(V, 64)
    b.add_request("big", SamplingParams(temperature=1.0, top_k=top_k, seed=1), [1])
    b.add_request("off", SamplingParams(temperature=1.0, seed=1), [1])
    host = b.build_host(["big", "off"], 2)
    assert host.fields["top_k"].tolist() == [0, 0]  # vLLM: top_k >= vocab keeps everything
    logits = np.random.RandomState(0).randn(2, V).astype(np.float32)
    logits[1] = logits[0]
    toks = _sample(b, ["big", "off"], logits)
    assert toks[0] == toks[1]  # same seed, same distribution: the same draw


def test_top_k_inside_vocab_is_kept():
    b = SamplingInputBuilder(V, 64)
    b.add_request("k", SamplingParams(temperature=1.0, top_k=7), [1])
    assert b.build_host(["k"], 1).fields["top_k"].tolist() == [7]


def test_huge_seeds_and_values_fit_their_dtypes():
    b = SamplingInputBuilder(V, 64)
    params = SamplingParams(temperature=1.0, seed=2**200 + 5, presence_penalty=1.0)
    params.logit_bias = {3: 10**400, 4: -(10**400)}  # past float64 even
    params.temperature = 10**400
    b.add_request("r", params, [1, 2])
    host = b.build_host(["r"], 1)
    assert np.isfinite(host.fields["temperature"]).all()
    assert np.isfinite(host.fields["bias_vals"][0, :2]).all()
    assert host.fields["bias_vals"][0, 0] > 1e38 and host.fields["bias_vals"][0, 1] < -1e38
    # The seed is taken modulo 2**64, like any other seed.
    b.add_request("s", SamplingParams(temperature=1.0, seed=5), [1])
    b.add_request("t", SamplingParams(temperature=1.0, seed=2**64 + 5), [1])
    u = b.build_host(["s", "t"], 2).fields["uniform"]
    assert u[0] == u[1]


def test_unchecked_request_is_clamped_not_raised(caplog):
    b = SamplingInputBuilder(V, 64, max_bias_tokens=4, max_allowed_tokens=2, max_logprobs=2)
    params = SamplingParams(temperature=0.0, logprobs=9, repetition_penalty=1.5,
                            logit_bias={t: 1.0 for t in range(10)},
                            allowed_token_ids=[5, 6, 7, V + 3, -1])
    params.logit_bias[V + 10] = 1.0
    b.add_request("r", params, [1, V + 50, -3, 2**40], [9])
    assert "--max-logprobs" in caplog.text
    host = b.build_host(["r"], 1)
    f = host.fields
    assert ((f["bias_ids"] >= 0) & (f["bias_ids"] <= V)).all() and f["bias_ids"].shape == (1, 4)
    assert f["allowed_ids"][0].tolist() == [5, 6]
    assert sorted(f["pen_ids"][0, :2].tolist()) == [1, 9] and (f["pen_ids"][0, 2:] == V).all()
    logits = np.zeros((1, V), np.float32)
    assert _sample(b, ["r"], logits)[0] in (5, 6)


def test_variant_is_the_cheapest_serving_cover():
    b = SamplingInputBuilder(V, 64, variants=SERVING_VARIANTS)
    assert b.variants() == SERVING_VARIANTS
    b.add_request("g", SamplingParams(temperature=0.0), [1])
    b.add_request("glp", SamplingParams(temperature=0.0, logprobs=1), [1])
    b.add_request("t", SamplingParams(temperature=1.0), [1])
    b.add_request("tk", SamplingParams(temperature=1.0, top_k=3), [1])
    b.add_request("pen", SamplingParams(temperature=0.0, presence_penalty=0.5), [1])
    b.add_request("so", SamplingParams(temperature=0.0, structured_outputs={"regex": "a+"}), [1])
    full = SamplerVariant(True, True, True, True, True)
    assert b.variant_of(["g"]) == SamplerVariant()
    assert b.variant_of(["g", "glp"]) == SamplerVariant(logprobs=True)
    assert b.variant_of(["g", "t"]) == SamplerVariant(random=True)
    assert b.variant_of(["t", "tk"]) == SamplerVariant(random=True, filters=True)
    assert b.variant_of(["pen"]) == full
    assert b.variant_of(["glp", "t"]) == full
    # A constrained row: the mask with plain sampling, or everything.
    assert b.variant_of(["so", "g"]) == SamplerVariant(random=True, filters=True, structured=True)
    assert b.variant_of(["so", "glp"]) == full
    # build() uses the variant it is given (computed once per step), padding the extra parts.
    md = b.build(["g"], 2, full)
    assert md.variant == full and md.pen_ids.shape == (2, 64)
    assert md.bitmask.shape == (2, (V + 31) // 32) and (np.asarray(md.bitmask) == -1).all()
    # Greedy rows, padded to the full program, still pick the argmax.
    logits = np.random.RandomState(1).randn(2, V).astype(np.float32)
    out = np.asarray(sample_jit(jnp.asarray(logits), md).sampled_token_ids)
    assert out[0] == logits[0].argmax()


def test_no_cover_is_a_clear_error():
    with pytest.raises(ValueError, match="covers"):
        covering_variant(SamplerVariant(processors=True), (SamplerVariant(),))


def test_consecutive_steps_of_one_batch_reuse_rows_but_never_stale_values():
    """The last step's metadata is reused for the same rows (decode steps of one batch): the
    uniforms of sampling rows still move on with their outputs, and an added, removed or
    rewritten row is never served from the old metadata."""
    cached = SamplingInputBuilder(V, 64, variants=SERVING_VARIANTS)

    def fresh_build(ids, rows, variant):
        cached._last_host, cached._last_variant = ((), -1, None), ((), -1, None)
        return cached.build_host(ids, rows, variant).packed()

    cached.add_request("g", SamplingParams(temperature=0.0), [1])
    cached.add_request("s", SamplingParams(temperature=0.8, top_p=0.9, seed=3), [1])
    for ids in (["g"], ["g", "s"], ["g", "s"], ["s", "g"]):
        for _ in range(3):
            variant = cached.variant_of(list(ids))
            got = cached.build_host(list(ids), 8, variant).packed().copy()
            assert np.array_equal(got, fresh_build(list(ids), 8, cached.variant_of(list(ids))))
            cached.count_outputs(ids)  # the next step's uniform differs for "s"
    greedy = cached.build_host(["g"], 8, cached.variant_of(["g"]))
    assert cached.build_host(["g"], 8, cached.variant_of(["g"])) is greedy  # reused as it is
    # The row rewritten (a preempted request re-added with other params): never the old values.
    before = cached.build_host(["g", "s"], 8, cached.variant_of(["g", "s"]))
    cached.remove_request("s")
    cached.add_request("s", SamplingParams(temperature=0.5, top_p=0.5, seed=1), [1])
    variant = cached.variant_of(["g", "s"])
    assert variant == before.variant
    assert cached.build_host(["g", "s"], 8, variant).fields["temperature"][1] == np.float32(0.5)
    assert not cached.variant_of(["g"]).random
    cached.remove_request("g")
    cached.add_request("g", SamplingParams(temperature=0.7), [1])
    assert cached.variant_of(["g"]).random
