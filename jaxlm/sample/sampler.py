"""The sampler: logits [R, V] + SamplingMetadata -> token ids (+ raw logprobs), all on device.

Order of operations follows vLLM's v1 Sampler:
  raw logprobs (log_softmax of the model's logits, before anything else; vLLM's default
  logprobs_mode "raw_logprobs")
  -> structured-output bitmask -> allowed_token_ids mask -> bad words / min_tokens bans + logit_bias -> penalties
  -> all rows greedy: argmax
  -> else: temperature -> min_p -> top-k -> top-p -> inverse-CDF draw with the row's uniform
     (greedy rows in such a batch: temperature 1, min_p 1, smallest uniform = their argmax).

Logprobs and the grammar mask: vLLM applies the bitmask to the logits before its sampler, so
its logprobs are post-mask. jaxlm applies it inside the sampler after the raw logprobs, as it
does allowed_token_ids: logprobs stay the model's own distribution (how likely the model found
the token the constraint let through), the same for constrained and unconstrained rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxlm.sample.ops as ops
from jaxlm.structured_output.bitmask import apply_token_bitmask
from jaxlm.core.outputs import LogprobsLists
from jaxlm.sample.metadata import SamplerOutput, SamplerVariant, SamplingMetadata


def apply_logits_processors(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Everything that can change the argmax (vLLM's order); neutral rows are unchanged."""
    logits = ops.apply_allowed(logits, md.allowed_ids, md.has_allowed)
    logits = ops.apply_bias(logits, md.bias_ids, md.bias_vals)
    return ops.apply_penalties(logits, md.pen_ids, md.pen_counts, md.presence_penalty,
                               md.frequency_penalty, md.repetition_penalty)


def _sample_random(logits: jax.Array, md: SamplingMetadata, filters: bool) -> jax.Array:
    x = logits / md.temperature[:, None]
    xmax = jnp.max(x, axis=-1)
    # min_p: keep p >= min_p * p_max  <=>  x >= x_max + log(min_p) (log(0) = -inf: no-op).
    x = jnp.where(x < (xmax + jnp.log(md.min_p))[:, None], -jnp.inf, x)
    if filters:
        t = ops.top_k_top_p_threshold(x, md.top_k, md.top_p, md.num_candidates)
        x = jnp.where(x < t[:, None], -jnp.inf, x)
    return ops.categorical_inverse_cdf(x, xmax, md.uniform)


def sample(logits: jax.Array, md: SamplingMetadata,
           variant: SamplerVariant | None = None) -> SamplerOutput:
    """Sample one token per row. Call inside jax.jit; `variant` (static) defaults to md.variant.

    Padding rows are greedy with neutral parameters; their tokens are meaningless.
    """
    if variant is not None and variant != md.variant:
        raise ValueError(f"variant {variant} does not match the metadata's {md.variant}")
    variant = md.variant
    logits = logits.astype(jnp.float32)
    raw_logits = logits  # logprobs are of the model's distribution, before any processing
    if variant.structured:
        logits = apply_token_bitmask(logits, md.bitmask)
    if variant.processors:
        logits = apply_logits_processors(logits, md)
    if variant.random:
        # Greedy rows come as min_p = 1 + the smallest uniform: the draw is their argmax.
        token_ids = _sample_random(logits, md, variant.filters)
    elif variant.logprobs and not (variant.processors or variant.structured) and md.max_logprobs > 0:
        # Unprocessed greedy: the argmax is the first of the raw top-k (ties at the max go to
        # the lower index, like argmax), so skip a pass over the logits.
        return SamplerOutput(*ops.greedy_with_logprobs(raw_logits, md.max_logprobs))
    else:
        token_ids = ops.fast_argmax(logits)
    if not variant.logprobs:
        return SamplerOutput(sampled_token_ids=token_ids)
    ids, lps, ranks = ops.gather_logprobs(raw_logits, token_ids, md.max_logprobs)
    return SamplerOutput(token_ids, ids, lps, ranks)


def compute_prompt_logprobs(logits: jax.Array, next_token_ids: jax.Array, k: int):
    """Raw logprobs of prompt positions: logits [P, V] predict next_token_ids [P].

    Returns (ids [P, 1+k], logprobs [P, 1+k], ranks [P]) with the actual next token first
    (vLLM's prompt_logprobs layout). `k` must be static (e.g. max_logprobs); slice per request.
    """
    return ops.gather_logprobs(logits, next_token_ids.astype(jnp.int32), k)


def to_host(out: SamplerOutput, num_reqs: int) -> tuple[np.ndarray, LogprobsLists | None]:
    """Device -> host for the first num_reqs rows: (token ids [n], LogprobsLists or None).

    One device_get for everything; LogprobsLists rows follow the same request order.
    """
    host = jax.device_get(out)
    ids = np.asarray(host.sampled_token_ids)[:num_reqs]
    if host.logprobs is None:
        return ids, None
    return ids, LogprobsLists(np.asarray(host.logprob_token_ids)[:num_reqs],
                              np.asarray(host.logprobs)[:num_reqs],
                              np.asarray(host.sampled_token_ranks)[:num_reqs])


# One jitted entry point for callers that do not fuse the sampler into a bigger program.
sample_jit = jax.jit(sample, static_argnames=("variant",))
compute_prompt_logprobs_jit = jax.jit(compute_prompt_logprobs, static_argnames=("k",))
