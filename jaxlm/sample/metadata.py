"""SamplingMetadata (device arrays, one row per request, padded to a bucket) and its variants.

The metadata is a registered pytree: its arrays are the traced leaves, and `variant` plus the
static sizes are aux data, so `jax.jit(step)(..., md)` compiles one program per
(row bucket, variant) and never per request. `SamplingInputBuilder` (jaxlm.sample.builder)
fills it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxlm.executor.distributed import place_inputs


class SamplerVariant(NamedTuple):
    """Which parts of the sampler a batch needs; static (one compiled program each).

    random:     some row samples (temperature > 0); else every row is greedy (argmax only).
    filters:    some sampling row has top_k or top_p (only with random).
    processors: some row has penalties, logit_bias, allowed_token_ids, bad_words or min_tokens.
    logprobs:   some row asked for logprobs (top-`max_logprobs` of the raw distribution).
    structured: some row has a structured-output constraint: a packed token bitmask
                ([R, ceil(V/32)] int32, all -1 on unconstrained rows) is one more input.

    These are static flags rather than lax.cond because on XLA:CPU any control flow around
    the [R, V] logits costs ~40 ms at 64 x 49152, even when the branch is not taken.
    """

    random: bool = False
    filters: bool = False
    processors: bool = False
    logprobs: bool = False
    structured: bool = False


# 24 programs per row bucket (filters only matter with random).
ALL_VARIANTS: tuple[SamplerVariant, ...] = tuple(
    SamplerVariant(*flags) for flags in itertools.product((False, True), repeat=5)
    if flags[0] or not flags[1])

# What the serving engine compiles per row bucket: a batch runs the cheapest one that covers
# what it needs (the extra parts are neutral for rows that don't use them), so the count stays
# 6 per bucket instead of every combination of the flags. Constrained steps take one of the
# two variants with the mask: plain sampling (greedy rows sample as argmax in a random
# variant), or everything; the others never carry the mask input.
SERVING_VARIANTS: tuple[SamplerVariant, ...] = (
    SamplerVariant(),
    SamplerVariant(logprobs=True),
    SamplerVariant(random=True),
    SamplerVariant(random=True, filters=True),
    SamplerVariant(random=True, filters=True, structured=True),
    SamplerVariant(True, True, True, True, True),
)


def covering_variant(need: SamplerVariant, variants: tuple[SamplerVariant, ...]) -> SamplerVariant:
    """The variant of `variants` with the fewest parts among those having every part of `need`."""
    fits = [v for v in variants if all(has or not wants for wants, has in zip(need, v))]
    if not fits:
        raise ValueError(f"no compiled sampler variant covers {need}")
    return min(fits, key=sum)


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    # ---- always present, [R]
    # Greedy rows are encoded by min_p = 1 and the smallest uniform (see the builder).
    temperature: jax.Array  # float32; 1.0 on greedy and padding rows (never divides by 0)
    top_k: jax.Array  # int32; 0 = off
    top_p: jax.Array  # float32; 1.0 = off
    min_p: jax.Array  # float32; 0.0 = off; 1.0 on greedy and padding rows
    # float32 in (0, 1]: this step's random number for the row, a hash of (the request's seed
    # or engine seed + request id, number of output tokens so far), made on the host. A PRNG on
    # device (threefry) brings while loops, which slow XLA:CPU's whole program ~5x.
    uniform: jax.Array
    # ---- present when variant.processors, else None
    presence_penalty: jax.Array | None = None  # [R] float32
    frequency_penalty: jax.Array | None = None  # [R] float32
    repetition_penalty: jax.Array | None = None  # [R] float32
    pen_ids: jax.Array | None = None  # [R, L] int32: distinct prompt+output tokens, pad = V
    pen_counts: jax.Array | None = None  # [R, L] int32: their counts in the output
    bias_ids: jax.Array | None = None  # [R, Kb] int32, pad = V
    bias_vals: jax.Array | None = None  # [R, Kb] float32 (-inf = banned)
    allowed_ids: jax.Array | None = None  # [R, Ka] int32, pad = V
    has_allowed: jax.Array | None = None  # [R] bool
    # ---- present when variant.structured, else None
    bitmask: jax.Array | None = None  # [R, ceil(V/32)] int32, bit set = allowed; -1 = no constraint
    # ---- present when the engine speculates (jaxlm/spec_decode/rejection_sampler.py), else None.
    # A request's rows are contiguous: its last token's, then one per draft token.
    draft_token_ids: jax.Array | None = None  # [R] int32: the draft this row must sample; -1 (none) on a last row
    spec_row_start: jax.Array | None = None  # [R] int32: the first row of the row's request
    # ---- static (pytree aux data)
    variant: SamplerVariant = SamplerVariant()
    max_logprobs: int = 20
    num_candidates: int = 256  # top-k/top-p candidates (see ops.top_k_top_p_threshold)

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])


_DATA_FIELDS = [f.name for f in dataclasses.fields(SamplingMetadata)
                if f.name not in ("variant", "max_logprobs", "num_candidates")]
jax.tree_util.register_dataclass(
    SamplingMetadata, data_fields=_DATA_FIELDS,
    meta_fields=["variant", "max_logprobs", "num_candidates"])


@dataclasses.dataclass
class SamplerOutput:
    sampled_token_ids: jax.Array  # [R] int32
    # Present when variant.logprobs: [R, 1 + max_logprobs], sampled token first, then top-k.
    logprob_token_ids: jax.Array | None = None
    logprobs: jax.Array | None = None
    sampled_token_ranks: jax.Array | None = None  # [R] int32, 1 = most likely


jax.tree_util.register_dataclass(
    SamplerOutput,
    data_fields=["sampled_token_ids", "logprob_token_ids", "logprobs", "sampled_token_ranks"],
    meta_fields=[])


@dataclasses.dataclass
class HostArrays:
    """Numpy twin of SamplingMetadata, filled by the builder: packed() for the runner (one int32
    buffer), to_device() for callers that want the arrays on the device as a pytree."""

    fields: dict[str, np.ndarray]
    variant: SamplerVariant
    max_logprobs: int
    num_candidates: int
    # Speculative rows (sample/spec_rows.py SpecRows) when the step verifies drafts, else None.
    spec_rows: Any = None
    # packed()'s buffer, made on its first call: the fields are final by then (a constrained
    # step fills its mask first). Never written after: a program may still be reading it.
    _packed: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return int(self.fields["temperature"].shape[0])

    def layout(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """(field, shape, dtype) of each array in packed(): static per (rows, variant)."""
        return tuple((k, a.shape, a.dtype.str) for k, a in self.fields.items())

    def packed(self) -> np.ndarray:
        """Every field in one int32 buffer (floats bit-cast, bools widened): one transfer
        with the body's inputs instead of one per array; unpack_metadata reverses it."""
        if self._packed is not None:
            return self._packed
        parts = [a.view(np.int32) if a.dtype == np.float32 else a.astype(np.int32, copy=False)
                 for a in self.fields.values()]
        self._packed = np.concatenate([p.ravel() for p in parts])
        return self._packed

    def to_device(self, sharding=None) -> SamplingMetadata:
        arrays = place_inputs(self.fields, sharding)
        return SamplingMetadata(**arrays, variant=self.variant, max_logprobs=self.max_logprobs,
                                num_candidates=self.num_candidates)



def unpack_metadata(flat: jax.Array, layout: tuple[tuple[str, tuple[int, ...], str], ...],
                    variant: SamplerVariant, max_logprobs: int, num_candidates: int) -> SamplingMetadata:
    """Inside jit: HostArrays.packed()'s buffer -> SamplingMetadata (layout from HostArrays.layout())."""
    arrays, offset = {}, 0
    for name, shape, dtype in layout:
        n = int(np.prod(shape, dtype=np.int64))
        x = flat[offset:offset + n].reshape(shape)
        offset += n
        dt = np.dtype(dtype)
        if dt == np.float32:
            x = jax.lax.bitcast_convert_type(x, jax.numpy.float32)
        elif dt == np.bool_:
            x = x != 0
        arrays[name] = x
    return SamplingMetadata(**arrays, variant=variant, max_logprobs=max_logprobs, num_candidates=num_candidates)
