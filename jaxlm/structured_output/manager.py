"""StructuredOutputManager: compile constraints once, track one matcher per request, fill masks.

Lifecycle (what the engine and the runner call; names follow vLLM's v1 structured outputs):

    mgr = StructuredOutputManager(tokenizer, vocab_size=model_vocab, eos_token_ids=[...])
    # admission (a bad constraint fails only its own request, as a ValueError -> HTTP 400):
    so_req = mgr.new_request(params.structured_outputs)
    # each step, on the host, for the rows being sampled:
    bitmask = mgr.allocate_bitmask(num_rows)           # all -1: rows without a constraint
    mgr.fill_bitmask(bitmask, [(so_req, row), ...])     # constrained rows only
    logits = apply_token_bitmask(logits, bitmask)       # in the sampler, before temperature
    # after the step, per constrained request:
    so_req.accept_token(token)       # False: the token broke the grammar (matcher now errored)
    if so_req.is_terminated(): ...   # grammar accepts nothing but EOS: finish_reason "stop"

Compiling is the expensive part (llguidance builds the lexer and parser tables against the
vocabulary when the first ``LLMatcher`` is made); the manager keeps that matcher, never advanced,
as a template in a bounded LRU cache keyed by ``params.cache_key()`` and gives every request a
``deep_copy`` of it (microseconds). A matcher lives on the host, so preemption (recompute) keeps
it as is; ``rollback(n)`` undoes tokens (speculative or asynchronous steps), and
``new_request(params, replay_tokens=output_ids)`` rebuilds one from the accepted output tokens.

Vocabulary: masks are sized by the *model's* vocabulary ``V`` (``ceil(V/32)`` int32 words per
row); ids the tokenizer does not define (a padded embedding) are never allowed.

Measured (scripts/dev/bench_structured.py, SmolLM2's tokenizer, V = 49152, a 2-CPU host): tokenizer
0.7-1 s once; a 7-property JSON schema compiles in ~0.7 ms (regex/choice/Lark alike), ~0.03 ms
cached; one mask fill is ~21 us median / ~0.14 ms p90 for one row, ~7 us per row batched (16-64
rows; p90 ~0.1 ms per row inside free-text strings); accepting a token ~1 us. The mask for step
N+1 needs step N's token, so fill it while the device runs step N+1's model body.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from jaxlm.structured_output.bitmask import bitmask_width
from jaxlm.structured_output.grammar import build_grammar
from jaxlm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked constraint: its llguidance grammar text and a start-state template matcher."""

    kind: str
    key: tuple[str, str, str]
    grammar: str
    template: llguidance.LLMatcher  # never advanced; every request gets a deep copy


class _MaskWriter:
    """Writes llguidance masks into ``[rows, ceil(V/32)]`` int32 arrays sized by the model's V.

    llguidance writes exactly ``ceil(n/32)`` words for its vocabulary of ``n`` ids. The manager
    builds that vocabulary as ``max(V, tokenizer ids)``, so when the model's vocab is the larger
    (the usual padded embedding) the words match and the extra ids come out disallowed; when the
    tokenizer is the larger (ids the model cannot emit) masks go through a scratch array and are
    cut to V.
    """

    def __init__(self, vocab_size: int, ll_vocab_size: int, executor: llguidance.LLExecutor):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.ll_width = bitmask_width(ll_vocab_size)
        self.executor = executor

    def check(self, bitmask: np.ndarray) -> None:
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self.width:
            raise ValueError(f"bitmask must be int32 [rows, {self.width}] for vocab {self.vocab_size}, "
                             f"got {bitmask.dtype} {list(bitmask.shape)}")
        if not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask must be C-contiguous")

    def fill(self, bitmask: np.ndarray, pairs: Sequence[tuple[llguidance.LLMatcher, int]]) -> None:
        self.check(bitmask)
        rows = [row for _, row in pairs]
        if rows and not all(0 <= r < bitmask.shape[0] for r in rows):
            raise ValueError(f"bitmask rows {rows} out of range for {bitmask.shape[0]} rows")
        if self.ll_width == self.width:
            self._fill_into(bitmask, list(pairs))
            return
        scratch = np.empty((len(pairs), self.ll_width), np.int32)
        self._fill_into(scratch, [(m, i) for i, (m, _) in enumerate(pairs)])
        bitmask[rows] = scratch[:, :self.width]
        if self.vocab_size % 32:  # clear ids >= V in the last word
            bitmask[rows, -1] &= np.int32((1 << (self.vocab_size % 32)) - 1)

    def _fill_into(self, out: np.ndarray, pairs: list[tuple[llguidance.LLMatcher, int]]) -> None:
        if len(pairs) == 1:  # one row: skip the executor's thread hand-off
            matcher, row = pairs[0]
            llguidance.numpy.fill_next_token_bitmask(matcher, out, row)
        elif pairs:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, pairs, out)


class StructuredOutputRequest:
    """One request's position in its constraint (an llguidance matcher) and its mask.

    Not thread-safe; owned by the engine loop like the request itself.
    """

    def __init__(self, compiled: CompiledGrammar, writer: _MaskWriter):
        self.kind = compiled.kind
        self._matcher = compiled.template.deep_copy()
        self._writer = writer
        self.num_accepted = 0  # tokens consumed and not rolled back

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False if the grammar rejects it (a masked sampler never
        picks such a token); the matcher then stays errored, terminated, and allows only EOS."""
        ok = self._matcher.consume_token(int(token_id))
        if ok:
            self.num_accepted += 1
        else:
            logger.warning("%s constraint rejected token %d: %s", self.kind, token_id, self.error)
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by several tokens; stops at the first rejected one (then returns False)."""
        for t in token_ids:
            if not self.accept_token(t):
                return False
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of these tokens, in order, the grammar would accept (nothing consumed)."""
        return self._matcher.validate_tokens([int(t) for t in token_ids]) if token_ids else 0

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative or asynchronous steps)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens of the {self.kind} constraint: "
                             f"{self.num_accepted} accepted")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"{self.kind} constraint failed to roll back {num_tokens} tokens: {self.error}")
        self.num_accepted -= num_tokens

    def reset(self) -> None:
        """Back to the start state (every accepted token undone)."""
        self._matcher.reset()
        self.num_accepted = 0

    def is_terminated(self) -> bool:
        """True when nothing but EOS may follow (the output is complete, or the matcher errored):
        the engine ends the request with finish_reason "stop"."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS is allowed now)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        """The matcher's error message; empty unless a token was rejected."""
        return self._matcher.get_error()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (bit ``i % 32`` of word ``i // 32``)."""
        self._writer.fill(bitmask, [(self._matcher, row)])


class StructuredOutputManager:
    """Per engine: the llguidance tokenizer (built once), the compile cache, the mask writer."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, eos_token_ids: Sequence[int] | None = None,
                 cache_size: int = 256, num_threads: int | None = None):
        """``tokenizer``: an HF fast tokenizer; ``vocab_size``: the model's logits width;
        ``eos_token_ids``: every id that ends a request (default the tokenizer's EOS);
        ``num_threads``: llguidance's mask threads (None: its default, ~80% of the CPUs)."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if cache_size <= 0:
            raise ValueError(f"cache_size must be positive, got {cache_size}")
        eos = list(eos_token_ids) if eos_token_ids else None
        self.eos_token_ids = eos  # a follower node builds its twin from them (same masks)
        self.ll_tokenizer = _build_ll_tokenizer(tokenizer, vocab_size, eos)
        self.vocab_size = vocab_size
        self._writer = _MaskWriter(vocab_size, self.ll_tokenizer.vocab_size,
                                   llguidance.LLExecutor(num_threads))
        # Short errors: verbose ones dump parser state and the whole grammar into the 400 body.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[tuple[str, str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # compile may run off the engine thread (the server's)
        self.cache_hits = 0
        self.cache_misses = 0

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return self._writer.width

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The checked grammar for ``params``, from the cache when the same (kind, text,
        whitespace) was compiled before. Raises ValueError naming the constraint and the problem."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return hit
        kind = params.kind
        grammar = build_grammar(params)
        # Building the matcher is the real compile (lexer/parser tables; it releases the GIL).
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise ValueError(f"invalid {kind} constraint: {template.get_error().strip()}")
        for w in template.get_grammar_warnings():
            logger.warning("%s constraint: %s", kind, w)
        compiled = CompiledGrammar(kind, key, grammar, template)
        with self._lock:
            self.cache_misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_request(self, params: StructuredOutputsParams,
                    replay_tokens: Sequence[int] = ()) -> StructuredOutputRequest:
        """A fresh matcher for one request (vLLM's ``grammar_init``), advanced by
        ``replay_tokens`` (the accepted output tokens) when rebuilding one, e.g. after a restart.
        Raises ValueError if compiling fails or the replayed tokens break the constraint."""
        req = StructuredOutputRequest(self.compile(params), self._writer)
        if replay_tokens and not req.accept_tokens(replay_tokens):
            raise ValueError(f"{req.kind} constraint rejects replayed output token "
                             f"{req.num_accepted} of {len(replay_tokens)}: {req.error}")
        return req

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """A ``[num_rows, ceil(V/32)]`` int32 mask with every token allowed (-1 = all bits set)."""
        return np.full((num_rows, self.bitmask_width), -1, dtype=np.int32)

    def fill_bitmask(self, bitmask: np.ndarray,
                     requests: Sequence[tuple[StructuredOutputRequest, int]]) -> None:
        """Fill the rows of many requests at once (llguidance's thread pool, GIL released).

        ``requests``: (request, row) pairs with distinct rows; other rows are left untouched.
        """
        self._writer.fill(bitmask, [(r._matcher, row) for r, row in requests])

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()


def _build_ll_tokenizer(tokenizer: Any, vocab_size: int, eos: list[int] | None) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` with max(vocab_size, tokenizer ids) ids (~1 s at 128k)."""
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError as e:
        if "vocab size too small" not in str(e):  # e.g. "Only fast tokenizers are supported"
            raise ValueError(f"structured outputs need an HF fast tokenizer: {e}") from None
    # The tokenizer defines ids beyond the model's vocab: keep them; masks are cut to V.
    return llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
