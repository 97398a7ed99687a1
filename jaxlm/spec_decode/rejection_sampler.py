"""The rejection sampler, on the device: every row of a verify step is sampled, then a request's
output is its rows up to and including the first whose token differs from the next draft.

Both proposers are deterministic (n-gram lookup; a draft model's argmax, as vLLM v1's draft
proposers), so the draft distribution q is one-hot. Standard speculative sampling then accepts
draft d with probability min(1, p(d)/q(d)) = p(d) and, on rejection, samples from the normalised
(p - q)+ = p without d. Drawing x ~ p at that position and accepting iff x == d (outputting x
either way) has exactly that law, so the sampler draws every row from p with the random number
the position would use without speculation (sample/spec_rows.py): temperature > 0 keeps the
target's distribution, greedy is the argmax (token-identical), and a seeded request gives the
same tokens as without speculation. The last row's draw is the bonus token. Rows that are not
outputs come back as -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.sample.metadata import SamplerOutput, SamplingMetadata
from jaxlm.sample.sampler import sample


def accepted_rows(token_ids: jax.Array, draft_token_ids: jax.Array, spec_row_start: jax.Array) -> jax.Array:
    """[R] bool: a row is an output when every earlier row of its request sampled its draft."""
    mismatch = (token_ids != draft_token_ids).astype(jnp.int32)
    before = jnp.cumsum(mismatch) - mismatch  # mismatches in rows [0, r)
    return before == before[spec_row_start]


def rejection_sample(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
    """sample() on every row, then the rows past a request's first rejected draft set to -1."""
    out = sample(logits, md)
    ok = accepted_rows(out.sampled_token_ids, md.draft_token_ids, md.spec_row_start)
    out.sampled_token_ids = jnp.where(ok, out.sampled_token_ids, -1)
    return out
