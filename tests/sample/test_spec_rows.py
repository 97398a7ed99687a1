"""A verify step's rows: row j of a request is the row a step without speculation would build
after drafts 1..j were its outputs (random number, penalties, min_tokens and bad-word bans)."""

from __future__ import annotations

import numpy as np

from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sample.metadata import SERVING_VARIANTS, SamplerVariant
from jaxlm.sampling_params import SamplingParams

V = 300
FULL = SamplerVariant(True, True, True, True, False)


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=20, seed=seed, presence_penalty=0.4, frequency_penalty=0.2,
                          repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7], logit_bias={11: 1.5},
                          bad_words_token_ids=[[40, 41], [50]], max_tokens=50)


def test_draft_rows_equal_sequential_rows():
    spec = SamplingInputBuilder(V, 128, variants=SERVING_VARIANTS, speculative=True)
    prompts = {"a": [40, 9, 9], "b": [1, 2]}
    drafts = {"a": [40, 41, 9], "b": []}
    for r, p in prompts.items():
        spec.add_request(r, _params(len(r) + ord(r[0])), p, output_token_ids=[5])
    host = spec.build_host(["a", "b"], 8, FULL, [drafts["a"], drafts["b"]])
    f = host.fields
    assert f["draft_token_ids"][:5].tolist() == [40, 41, 9, -1, -1]
    assert f["spec_row_start"][:8].tolist() == [0, 0, 0, 0, 4, 5, 6, 7]
    row = 0
    for r in ("a", "b"):
        for j in range(len(drafts[r]) + 1):
            # The same request without speculation, after drafts 1..j were sampled.
            seq = SamplingInputBuilder(V, 128, variants=SERVING_VARIANTS)
            seq.add_request(r, _params(len(r) + ord(r[0])), prompts[r], output_token_ids=[5] + drafts[r][:j])
            one = seq.build_host([r], 1, FULL).fields
            for name, arr in one.items():
                assert np.array_equal(f[name][row], arr[0]), (r, j, name)
            row += 1
    # The builder's own state is untouched by the draft rows.
    again = spec.build_host(["a"], 1, FULL).fields
    assert np.array_equal(again["pen_counts"][0], f["pen_counts"][0])
