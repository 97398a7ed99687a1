"""apply_token_bitmask (JAX, jitted) against its numpy reference, and the packing convention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.structured_output.bitmask import (
    allowed_token_ids, apply_token_bitmask, apply_token_bitmask_np, bitmask_width, unpack_bitmask_np)


def _random_case(rows, vocab, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(rows, bitmask_width(vocab)), dtype=np.int64).astype(np.int32)
    return logits, bitmask


@pytest.mark.parametrize("vocab", [32, 33, 400, 1000])
def test_jax_matches_numpy_reference(vocab):
    logits, bitmask = _random_case(5, vocab, vocab)
    bitmask[0] = -1  # an unconstrained row is untouched
    want = apply_token_bitmask_np(logits, bitmask)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, bitmask))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0], logits[0])
    assert np.isneginf(got).any() and np.isfinite(got).any()


def test_bit_convention_and_dtype():
    vocab = 70
    bitmask = np.zeros((2, bitmask_width(vocab)), np.int32)
    bitmask[0, 0] = 1 << 3            # token 3
    bitmask[0, 1] = np.int32(-2**31)  # token 63 (the sign bit)
    bitmask[0, 2] = 1 << 5            # token 69, the last one
    bitmask[1, 2] = 1 << 6            # token 70: beyond the vocab, so nothing is allowed
    assert allowed_token_ids(bitmask[0], vocab).tolist() == [3, 63, 69]
    logits = jnp.ones((2, vocab), jnp.bfloat16)
    out = apply_token_bitmask(logits, jnp.asarray(bitmask))
    assert out.dtype == jnp.bfloat16 and out.shape == (2, vocab)
    assert np.flatnonzero(np.isfinite(np.asarray(out[0], np.float32))).tolist() == [3, 63, 69]
    assert not np.isfinite(np.asarray(out[1], np.float32)).any()
    assert unpack_bitmask_np(bitmask, vocab).sum() == 3


def test_shape_errors_name_the_expected_shape():
    logits = np.zeros((2, 100), np.float32)
    with pytest.raises(ValueError, match=r"expected \[2, 4\]"):
        apply_token_bitmask(logits, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match=r"expected \[2, 4\]"):
        apply_token_bitmask_np(logits, np.zeros((3, 4), np.int32))
    with pytest.raises(ValueError, match="2-D"):
        apply_token_bitmask(logits[0], np.zeros((4,), np.int32))
