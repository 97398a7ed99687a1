"""The rejection sampler: a request's outputs are its rows up to its first rejected draft."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sample.metadata import SERVING_VARIANTS
from jaxlm.sampling_params import SamplingParams
from jaxlm.spec_decode.rejection_sampler import accepted_rows, rejection_sample


def test_accepted_rows_stop_at_the_first_rejection():
    # Requests: rows 0-3 (3 drafts), 4 (none), 5-7 (2 drafts), 8 (padding).
    tokens = jnp.array([5, 6, 9, 1, 3, 4, 8, 2, 0])
    drafts = jnp.array([5, 6, 7, -1, -1, 0, 8, -1, -1])
    start = jnp.array([0, 0, 0, 0, 4, 5, 5, 5, 8])
    ok = np.asarray(accepted_rows(tokens, drafts, start))
    # request 0: drafts 5, 6 accepted, 7 rejected (row 2 sampled 9): rows 0-2 are outputs;
    # request 2: its first draft (0) rejected: row 5 only.
    assert ok.tolist() == [True, True, True, False, True, True, False, False, True]


def test_greedy_rows_are_the_argmax_up_to_the_first_mismatch():
    V = 64
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, V)).astype(np.float32)
    argmax = logits.argmax(axis=1)
    builder = SamplingInputBuilder(V, 128, variants=SERVING_VARIANTS, speculative=True)
    for r in ("a", "b"):
        builder.add_request(r, SamplingParams(temperature=0.0), [1, 2, 3])
    # a: drafts = the argmax of rows 0, 1 then a wrong one; b: every draft right, a bonus row.
    drafts = [[int(argmax[0]), int(argmax[1]), (int(argmax[2]) + 1) % V], [int(argmax[4]), int(argmax[5])]]
    host = builder.build_host(["a", "b"], 8, builder.variant_of(["a", "b"]), drafts)
    out = jax.jit(rejection_sample)(jnp.asarray(logits), host.to_device())
    tokens = np.asarray(out.sampled_token_ids)
    assert tokens[:7].tolist() == [argmax[0], argmax[1], argmax[2], -1, argmax[4], argmax[5], argmax[6]]
