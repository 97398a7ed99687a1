"""StructuredOutputManager and StructuredOutputRequest: cache, errors, masks, EOS, rollback, replay."""

import json

import numpy as np
import pytest

from jaxlm.structured_output.bitmask import allowed_token_ids, unpack_bitmask_np
from jaxlm.structured_output.manager import StructuredOutputManager
from jaxlm.structured_output.params import StructuredOutputsParams as P
from tests.helpers.tiny_tokenizer import TINY_VOCAB
from tests.structured_output.so_helpers import BOUNDED_SCHEMA, MODEL_VOCAB

EOS = 2  # the tiny tokenizer's </s>


def _mask(req, width):
    m = np.full((1, width), -1, np.int32)
    req.fill_bitmask(m, 0)
    return m[0]


def test_same_constraint_compiles_once(tokenizer):
    mgr = StructuredOutputManager(tokenizer, MODEL_VOCAB, cache_size=2)
    a = mgr.compile(P(json=BOUNDED_SCHEMA))
    assert mgr.compile(P(json=json.dumps(BOUNDED_SCHEMA))) is a  # same (kind, text): a hit
    mgr.new_request(P(json=BOUNDED_SCHEMA))
    assert (mgr.cache_misses, mgr.cache_hits) == (1, 2)
    assert mgr.compile(P(json=BOUNDED_SCHEMA, disable_any_whitespace=True)) is not a
    mgr.compile(P(regex="a+"))  # a third key: the least recently used (the bounded schema) goes
    assert mgr.compile(P(json=BOUNDED_SCHEMA)) is not a
    assert mgr.cache_misses == 4


@pytest.mark.parametrize("params, match", [
    (P(json={"type": "foo"}), r"invalid json constraint: Invalid type: foo"),
    (P(json={"type": "string", "format": "bogus"}), r"invalid json constraint: Unknown format: bogus"),
    (P(json={"$ref": "#/defs/x"}), r"invalid json constraint: .*/defs/x"),
    (P(regex="a(b"), r"(?s)invalid regex constraint: .*unclosed group"),
    (P(grammar='start: x\nx: "a" y'), r'(?s)invalid grammar constraint: .*unknown name: "y"'),
    (P(grammar="start: foo ("), r"(?s)invalid grammar constraint: .*Expected token"),
])
def test_invalid_constraints_raise_value_error(manager, params, match):
    with pytest.raises(ValueError, match=match):
        manager.new_request(params)
    assert params.cache_key() not in manager._cache  # failures are not cached


def test_padded_vocab_ids_are_never_allowed(manager):
    assert manager.bitmask_width == (MODEL_VOCAB + 31) // 32 == 13
    req = manager.new_request(P(json_object=True))
    free = manager.new_request(P(regex="(?s:.)*"))  # any text: every real token allowed
    assert allowed_token_ids(_mask(req, 13), MODEL_VOCAB).max() < TINY_VOCAB
    ids = allowed_token_ids(_mask(free, 13), MODEL_VOCAB)
    assert ids.max() == TINY_VOCAB - 1 and EOS in ids and len(ids) > 250


def test_model_vocab_smaller_than_tokenizer(tokenizer, manager):
    # Ids the model cannot emit are cut; the rest of the mask is the full-vocab one.
    small = StructuredOutputManager(tokenizer, 300)
    assert small.bitmask_width == 10 and small.ll_tokenizer.vocab_size == TINY_VOCAB
    params = P(regex="(?s:.)*")
    rows = small.allocate_bitmask(3)
    small.fill_bitmask(rows, [(small.new_request(params), 0), (small.new_request(P(choice=["zz"])), 2)])
    full = _mask(manager.new_request(params), manager.bitmask_width)
    want = unpack_bitmask_np(full[None], MODEL_VOCAB)[0, :300]
    np.testing.assert_array_equal(unpack_bitmask_np(rows, 300)[0], want)
    assert (rows[1] == -1).all()  # a row not listed is untouched
    assert unpack_bitmask_np(rows[2:], 320)[0, 300:].sum() == 0  # bits past V cleared
    with pytest.raises(ValueError, match="out of range"):
        small.fill_bitmask(rows, [(small.new_request(params), 3)])


def test_batched_fill_equals_per_row_fill(manager):
    params = [P(json=BOUNDED_SCHEMA), P(regex="[a-z]{3}"), P(choice=["yes", "no"]), P(json_object=True)]
    reqs = [manager.new_request(p) for p in params]
    for r, prefix in zip(reqs, ['{"name": "a', "ab", "y", "{"]):
        assert r.accept_tokens(manager.ll_tokenizer.tokenize_str(prefix))
    batched = manager.allocate_bitmask(6)
    manager.fill_bitmask(batched, [(r, i + 1) for i, r in enumerate(reqs)])
    assert (batched[0] == -1).all() and (batched[5] == -1).all()
    for i, r in enumerate(reqs):
        np.testing.assert_array_equal(batched[i + 1], _mask(r, manager.bitmask_width))
    with pytest.raises(ValueError, match=r"int32 \[rows, 13\]"):
        manager.fill_bitmask(np.zeros((2, 12), np.int32), [(reqs[0], 0)])
    with pytest.raises(ValueError, match=r"int32 \[rows, 13\]"):
        manager.fill_bitmask(np.zeros((2, 13), np.int64), [(reqs[0], 0)])


def test_terminated_allows_only_eos(manager):
    req = manager.new_request(P(choice=["yes", "yes please"]))
    toks = manager.ll_tokenizer.tokenize_str("yes")
    assert req.accept_tokens(toks) and req.num_accepted == len(toks)
    assert req.is_accepting() and not req.is_terminated()  # " please" may follow, or EOS
    assert EOS in allowed_token_ids(_mask(req, 13), MODEL_VOCAB)
    assert req.accept_tokens(manager.ll_tokenizer.tokenize_str(" please"))
    assert req.is_terminated()  # the engine ends the request here: finish_reason "stop"
    assert allowed_token_ids(_mask(req, 13), MODEL_VOCAB).tolist() == [EOS]


def test_rejected_token_terminates_with_error(manager):
    req = manager.new_request(P(regex="[0-9]+"))
    letter = manager.ll_tokenizer.tokenize_str("x")[0]
    assert not req.accept_token(letter)
    assert req.is_terminated() and "doesn't satisfy the grammar" in req.error
    assert allowed_token_ids(_mask(req, 13), MODEL_VOCAB).tolist() == [EOS]
    assert req.num_accepted == 0


def test_rollback_and_replay_restore_the_state(manager):
    params = P(json=BOUNDED_SCHEMA)
    text = '{"name": "ab", "color": "red", "dims": {"w": 5, "unit": "cm"}}'
    toks = manager.ll_tokenizer.tokenize_str(text)
    req = manager.new_request(params)
    masks = []
    for t in toks:
        masks.append(_mask(req, 13))
        assert req.accept_token(t)
    assert req.is_terminated()
    for k in (1, 5, len(toks)):
        # A matcher rebuilt from the first n tokens has the same mask as the live one had then.
        n = len(toks) - k
        np.testing.assert_array_equal(_mask(manager.new_request(params, replay_tokens=toks[:n]), 13), masks[n])
        req.rollback(k)
        assert req.num_accepted == n
        np.testing.assert_array_equal(_mask(req, 13), masks[n])
        assert req.accept_tokens(toks[n:]) and req.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back"):
        req.rollback(len(toks) + 1)
    req.reset()
    np.testing.assert_array_equal(_mask(req, 13), masks[0])
    bad = manager.ll_tokenizer.tokenize_str('{"nope"')
    with pytest.raises(ValueError, match=r"json constraint rejects replayed output token"):
        manager.new_request(params, replay_tokens=bad)


def test_eos_token_ids_override(tokenizer):
    mgr = StructuredOutputManager(tokenizer, MODEL_VOCAB, eos_token_ids=[2, 1])
    req = mgr.new_request(P(choice=["ok"]))
    assert req.accept_tokens(mgr.ll_tokenizer.tokenize_str("ok")) and req.is_terminated()
    assert allowed_token_ids(_mask(req, 13), MODEL_VOCAB).tolist() == [1, 2]


def test_constructor_errors(tokenizer):
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        StructuredOutputManager(tokenizer, 0)
    with pytest.raises(ValueError, match="cache_size must be positive"):
        StructuredOutputManager(tokenizer, MODEL_VOCAB, cache_size=0)
