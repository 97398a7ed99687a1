"""Shared pieces of the structured-output tests: the tokenizer, schemas, and a decode simulator.

``simulate`` is constrained decoding as the engine will run it, with a random "model": each step
every row draws standard-normal logits over the model vocab, the rows' masks are filled in one
batched call, applied by both the jitted JAX function and the numpy reference (which must agree),
a token is drawn at temperature 1 (Gumbel-max), and the row's matcher accepts it. A row finishes
on EOS or when its matcher is terminated (the grammar allows nothing but EOS).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jax
import numpy as np
from transformers import PreTrainedTokenizerFast

from jaxlm.structured_output.bitmask import apply_token_bitmask, apply_token_bitmask_np, unpack_bitmask_np
from jaxlm.structured_output.manager import StructuredOutputManager
from jaxlm.structured_output.params import StructuredOutputsParams
from tests.helpers.tiny_tokenizer import TINY_VOCAB, add_tiny_tokenizer

MODEL_VOCAB = 400  # > the tokenizer's 384 ids (a padded embedding), and not a multiple of 32
NUM_SEEDS = 32

# Bounded: every string has maxLength, every array maxItems, every integer a range, and no
# additional properties, so the set of valid documents is finite.
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "dims": {
            "type": "object",
            "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 99},
                           "unit": {"enum": ["cm", "in"]}},
            "required": ["w", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "color", "dims"],
    "additionalProperties": False,
}
# The longest valid document with one-byte characters, and the number of string characters in it.
LONGEST_DOC = {"name": "x" * 8, "color": "green", "size": 999, "ok": False,
               "tags": ["x" * 4] * 3, "dims": {"w": 99, "unit": "cm"}}
LONGEST_DOC_STRING_CHARS = 8 + 3 * 4
# A token is at least one byte, and one string character is at most 12 bytes (an escaped
# surrogate pair), so this many tokens (+1 for EOS) bound every valid output.
BOUNDED_SCHEMA_MAX_TOKENS = len(json.dumps(LONGEST_DOC)) + 11 * LONGEST_DOC_STRING_CHARS + 1

REGEX = r"[A-Z][a-z]{1,6}-[0-9]{2,4}(\.[a-z]{2,3})?"
CHOICES = ["yes", "no", "yes please", "maybe 🙂", "n/a"]
ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


def tiny_bpe_tokenizer(path) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast.from_pretrained(add_tiny_tokenizer(path))
    assert len(tok) == TINY_VOCAB < MODEL_VOCAB
    return tok


@dataclass
class SimResult:
    texts: list[str | None] = field(default_factory=list)  # None: not finished in max_tokens
    token_ids: list[list[int]] = field(default_factory=list)
    ended_by_eos: list[bool] = field(default_factory=list)


def simulate(manager: StructuredOutputManager, params: StructuredOutputsParams, *, max_tokens: int,
             num_seeds: int = NUM_SEEDS, replay_at: int | None = None) -> SimResult:
    """Decode ``num_seeds`` rows (seed = row) under ``params``; see the module docstring.

    ``replay_at``: at that step every live row's matcher is rebuilt from its output tokens (as
    after a preemption) and must give the same mask as the one it replaces.
    """
    vocab, eos = manager.vocab_size, set(manager.ll_tokenizer.eos_tokens)
    reqs = [manager.new_request(params) for _ in range(num_seeds)]
    rngs = [np.random.default_rng(seed) for seed in range(num_seeds)]
    out: list[list[int]] = [[] for _ in range(num_seeds)]
    done, by_eos = [False] * num_seeds, [False] * num_seeds
    apply = jax.jit(apply_token_bitmask)
    for step in range(max_tokens):
        live = [i for i in range(num_seeds) if not done[i]]
        if not live:
            break
        if step == replay_at:
            _replace_by_replay(manager, params, reqs, out, live)
        bitmask = manager.allocate_bitmask(num_seeds)
        manager.fill_bitmask(bitmask, [(reqs[i], i) for i in live])
        allowed = unpack_bitmask_np(bitmask, vocab)
        assert not allowed[live, manager.ll_tokenizer.vocab_size:].any(), "padding ids allowed"
        assert allowed[live].any(axis=1).all(), "a live row allows no token"
        logits = np.stack([rng.standard_normal(vocab, dtype=np.float32) for rng in rngs])
        masked = apply_token_bitmask_np(logits, bitmask)
        np.testing.assert_array_equal(np.asarray(apply(logits, bitmask)), masked)
        gumbel = np.stack([rng.gumbel(size=vocab).astype(np.float32) for rng in rngs])
        tokens = np.argmax(masked + gumbel, axis=1)
        for i in live:
            t = int(tokens[i])
            assert allowed[i, t]
            assert reqs[i].accept_token(t), reqs[i].error
            if t in eos:
                done[i] = by_eos[i] = True
            else:
                out[i].append(t)
                done[i] = reqs[i].is_terminated()
    texts = [manager.ll_tokenizer.decode_bytes(o).decode("utf-8") if d else None for o, d in zip(out, done)]
    return SimResult(texts, out, by_eos)


def _replace_by_replay(manager, params, reqs, out, live) -> None:
    old_mask, new_mask = manager.allocate_bitmask(len(reqs)), manager.allocate_bitmask(len(reqs))
    fresh = {i: manager.new_request(params, replay_tokens=out[i]) for i in live}
    manager.fill_bitmask(old_mask, [(reqs[i], i) for i in live])
    manager.fill_bitmask(new_mask, [(fresh[i], i) for i in live])
    np.testing.assert_array_equal(new_mask, old_mask)
    for i in live:
        assert fresh[i].is_terminated() == reqs[i].is_terminated()
        reqs[i] = fresh[i]


def is_arith(text: str) -> bool:
    """Exactly ARITH_LARK's language, by recursive descent (no whitespace, numbers of 1-3 digits)."""
    toks = re.findall(r"[0-9]+|[-+*/()]|.", text)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take(ok) -> bool:
        nonlocal pos
        if peek() is not None and ok(peek()):
            pos += 1
            return True
        return False

    def factor() -> bool:
        if take(lambda t: t.isdigit() and len(t) <= 3):
            return True
        return take(lambda t: t == "(") and expr() and take(lambda t: t == ")")

    def chain(item, ops) -> bool:
        if not item():
            return False
        while take(lambda t: t in ops):
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(toks)
