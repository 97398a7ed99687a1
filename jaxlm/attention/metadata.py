"""What every attention backend reads for one step: the flattened, padded batch layout.

The runner flattens all scheduled tokens of a step into one ragged batch of T tokens
(padded up to a token bucket) belonging to R request rows (padded up to a row bucket).
Padding tokens have ``slot_mapping == -1`` (their K/V are never written); padding rows
have ``query_start_loc[r] == query_start_loc[r + 1]`` and ``seq_lens == context_lens == 0``.
Every array is device-resident and int32. ``max_query_len`` is not an array but a static
field (part of the pytree structure, so each value is its own compiled program): the runner
sets it to 1 for decode-only steps, which lets a backend pick a decode kernel at trace time.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    # [T] absolute position of each token in its sequence.
    positions: jax.Array
    # [T] flat cache slot (block_id * block_size + offset) for the token's new K/V; -1 = padding.
    slot_mapping: jax.Array
    # [T] row (request) each token belongs to; any valid row for padding tokens.
    token_to_req: jax.Array
    # [R, P] KV block ids per request; P = pages per request (max_model_len / block_size).
    block_tables: jax.Array
    # [R] tokens in the cache for the request after this step (context + new tokens).
    seq_lens: jax.Array
    # [R] tokens already in the cache before this step (prefix-cache hits, earlier chunks).
    context_lens: jax.Array
    # [R + 1] cumulative query lengths (cu_q_lens): tokens of row r are
    # query_start_loc[r]:query_start_loc[r + 1] in the flat batch.
    query_start_loc: jax.Array
    # Static: most query tokens any row has this step when known (1 = decode only), else None.
    max_query_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # [T] the last key position each token may attend to, when some tokens see past their own
    # (Gemma 3's image tokens see their whole image, models/gemma3_mm.py); None: causal, and
    # every model but such a multimodal one leaves it so (its programs are unchanged).
    attn_limits: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]
