"""SamplingInputBuilder: host-side, persistent per-request sampling state -> SamplingMetadata.

Everything that depends on a request's history (penalty counts, bad-word prefixes, output
length for min_tokens and for the random stream) is kept per request and updated by
`append_output` in O(1), so `build()` costs O(rows) plus a copy of each processor row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterable, Sequence

import numpy as np

from jaxlm.sample.metadata import ALL_VARIANTS, HostArrays, SamplerVariant, SamplingMetadata, covering_variant
from jaxlm.sample.processor_fields import fill_processor_fields
from jaxlm.sample.rows import SamplingRows
from jaxlm.sample.spec_rows import SpecRows, neutral_draft_fields, states_after_drafts
from jaxlm.sampling_params import SamplingParams
from jaxlm.structured_output.bitmask import bitmask_width

logger = logging.getLogger(__name__)

_M64 = (1 << 64) - 1


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIN_UNIFORM = np.float32(1.0 / (1 << 24))  # smallest value row_uniforms returns


_F32_MAX = float(np.finfo(np.float32).max)


def _stable_hash64(text: str) -> int:
    # Python's hash() is salted per process; the stream of an unseeded request must not be.
    # surrogatepass: a lone surrogate ("\ud800" is legal JSON) hashes instead of raising.
    data = text.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _f32(x: float) -> float:
    """x clamped into float32's finite range (a huge int would overflow numpy's conversion)."""
    return min(max(x, -_F32_MAX), _F32_MAX)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective, well-mixing hash of uint64 values."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def row_uniforms(streams: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The uniform in (0, 1] that row i uses at output position steps[i]: a pure function of
    (stream, step), so a request draws the same numbers whatever batch it is in."""
    with np.errstate(over="ignore"):
        z = _mix64(streams.astype(np.uint64) ^ _mix64(steps.astype(np.uint64) * _GOLDEN))
    return ((z >> np.uint64(40)).astype(np.float32) + 1.0) * np.float32(1.0 / (1 << 24))


@dataclasses.dataclass
class _ReqState:
    params: SamplingParams
    stream: int  # 64-bit random stream id: from the seed, or engine seed + request id
    # The row's values, already clamped into their array types (neutral for greedy rows).
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 1.0
    num_output: int = 0  # kept for rows with processors (min_tokens, bad words); SamplingRows counts all
    processors: bool = False
    # penalties (presence, frequency, repetition); distinct prompt+output tokens, output counts
    penalties: tuple[float, float, float] = (0.0, 0.0, 1.0)
    has_penalties: bool = False
    pen_ids: np.ndarray | None = None
    pen_counts: np.ndarray | None = None
    num_pen: int = 0
    pen_slot: dict[int, int] = dataclasses.field(default_factory=dict)
    # logit_bias (static part of the bias row), min_tokens stop ids, bad words
    bias_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    bias_vals: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    stop_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    bad_words: list[tuple[tuple[int, ...], int]] = dataclasses.field(default_factory=list)
    tail: list[int] = dataclasses.field(default_factory=list)  # last output tokens (bad words)
    tail_len: int = 0
    allowed: np.ndarray | None = None
    structured: bool = False  # has a structured-output constraint (the runner fills its mask row)


class SamplingInputBuilder:
    """Per-request sampling state on the host; `build()` makes a step's SamplingMetadata.

    vocab_size: the logits' last dimension. max_model_len bounds the distinct tokens of a
    sequence (penalty row width). max_bias_tokens / max_allowed_tokens are the fixed widths of
    the sparse logit_bias(+bans) and allowed_token_ids rows; larger requests are rejected.
    max_logprobs: the engine's cap (ModelConfig.max_logprobs, ``--max-logprobs``).
    variants: the sampler programs that exist; variant_of() picks the cheapest covering one.
    speculative: every metadata carries the rejection sampler's draft fields (sample/spec_rows.py).
    """

    def __init__(self, vocab_size: int, max_model_len: int, *, engine_seed: int = 0,
                 max_logprobs: int = 20, max_bias_tokens: int = 1024,
                 max_allowed_tokens: int = 1024, num_candidates: int = 256,
                 variants: Sequence[SamplerVariant] = ALL_VARIANTS, speculative: bool = False) -> None:
        self.vocab_size = vocab_size
        self.penalty_width = max(1, min(max_model_len, vocab_size))
        self.engine_seed = engine_seed
        self.max_logprobs = max_logprobs
        self.max_bias_tokens = max_bias_tokens
        self.max_allowed_tokens = max_allowed_tokens
        self.num_candidates = num_candidates
        self._variants = tuple(variants)
        self.speculative = speculative
        self._reqs: dict[str, _ReqState] = {}
        # Requests whose processors read their own outputs (record_tokens' only work).
        self._history: set[str] = set()
        # The per-step values of every request, gathered per step by index (see rows.py).
        self._rows = SamplingRows()
        # The last step's (req_ids, rows version, variant) and (req_ids, rows version, HostArrays):
        # consecutive decode steps of one batch reuse them (see variant_of and build_host).
        self._last_variant: tuple = ((), -1, None)
        self._last_host: tuple = ((), -1, None)

    # ------------------------------------------------------------ validation

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError for anything this sampler cannot honour (call at request admission)."""
        v = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.max_logprobs:
                raise ValueError(f"Requested {name}={n} exceeds max_logprobs={self.max_logprobs}; "
                                 "start the engine with a larger --max-logprobs")

        def check_ids(what: str, ids: Iterable[int]) -> None:
            bad = [t for t in ids if not 0 <= int(t) < v]
            if bad:
                raise ValueError(f"{what} contains out-of-vocab token ids {bad[:8]} (vocab size {v})")

        if params.logit_bias:
            check_ids("logit_bias", params.logit_bias)
        if params.allowed_token_ids is not None:
            check_ids("allowed_token_ids", params.allowed_token_ids)
            if len(set(params.allowed_token_ids)) > self.max_allowed_tokens:
                raise ValueError(f"allowed_token_ids has {len(set(params.allowed_token_ids))} ids; "
                                 f"at most {self.max_allowed_tokens} are supported")
        check_ids("stop_token_ids", params.stop_token_ids or ())
        if params.min_tokens:
            check_ids("stop token ids", params.all_stop_token_ids)
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("bad_words must be tokenized first (SamplingParams.update_from_tokenizer)")
        for word in params.bad_words_token_ids or ():
            if not word:
                raise ValueError("bad_words_token_ids contains an empty word")
            check_ids("bad_words", word)
        n_bias = (len(params.logit_bias or ()) + len(params.bad_words_token_ids or ())
                  + (len(params.all_stop_token_ids) if params.min_tokens else 0))
        if n_bias > self.max_bias_tokens:
            raise ValueError(f"logit_bias + bad_words + stop ids need {n_bias} entries; at most "
                             f"{self.max_bias_tokens} are supported")

    # ------------------------------------------------------------ request life

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int] = ()) -> None:
        """Register a request (again after preemption: pass the outputs so far).

        Never raises for a request's values: this runs inside the engine's step, so anything
        admission let through (it calls check_params) is clamped into the arrays' ranges here
        rather than allowed to kill the loop for every request.
        """
        try:
            self.check_params(params)
        except ValueError as e:
            logger.warning("request %r reached the sampler unchecked (%s); clamping its values", req_id, e)
        st = self._new_state(req_id, params)
        if st.has_penalties:
            for t in prompt_token_ids:
                self._pen_add(st, int(t), 0)
        self._reqs[req_id] = st
        if st.processors:
            self._history.add(req_id)
        self._rows.add(req_id, dict(temperature=st.temperature, top_k=st.top_k, top_p=st.top_p,
                                    min_p=st.min_p, stream=st.stream, greedy=st.greedy),
                       SamplerVariant(random=not st.greedy, filters=not st.greedy and (st.top_k > 0 or st.top_p < 1.0),
                                      processors=st.processors, logprobs=params.logprobs is not None,
                                      structured=st.structured))
        for t in output_token_ids:
            self.append_output(req_id, t)

    def _new_state(self, req_id: str, params: SamplingParams) -> _ReqState:
        v = self.vocab_size
        in_vocab = lambda ids: [int(t) for t in ids if 0 <= t < v]  # noqa: E731
        if params.seed is not None:
            stream = int(_mix64(np.array([int(params.seed) & _M64], np.uint64))[0])
        else:
            # Engine seed mixed with the request id: distinct per request, and a preempted,
            # re-added request continues the same stream.
            stream = _stable_hash64(f"engine:{self.engine_seed & _M64}:{req_id}")
        st = _ReqState(params=params, stream=stream, greedy=params.greedy,
                       structured=params.structured_outputs is not None)
        if not st.greedy:
            # top_k >= vocab keeps everything: the same as off (0), and always fits int32.
            k = int(params.top_k)
            st.top_k = 0 if k <= 0 or k >= v else k
            st.temperature, st.top_p, st.min_p = (
                _f32(params.temperature), _f32(params.top_p), _f32(params.min_p))
        st.penalties = (_f32(params.presence_penalty), _f32(params.frequency_penalty),
                        _f32(params.repetition_penalty))
        st.has_penalties = st.penalties != (0.0, 0.0, 1.0)
        if st.has_penalties:
            st.pen_ids = np.full(self.penalty_width, v, np.int32)
            st.pen_counts = np.zeros(self.penalty_width, np.int32)
        if params.logit_bias:
            bias = {int(t): _f32(b) for t, b in params.logit_bias.items() if 0 <= t < v}
            st.bias_ids = np.fromiter(bias.keys(), np.int32, len(bias))
            st.bias_vals = np.fromiter(bias.values(), np.float32, len(bias))
        if params.min_tokens:
            st.stop_ids = np.array(sorted(in_vocab(params.all_stop_token_ids)), np.int32)
        words = [w for w in params.bad_words_token_ids or () if w and 0 <= w[-1] < v]
        if words:
            st.bad_words = [(tuple(w[:-1]), int(w[-1])) for w in words]
            st.tail_len = max(len(w) for w in words) - 1
        if params.allowed_token_ids is not None:
            st.allowed = np.array(sorted(set(in_vocab(params.allowed_token_ids))), np.int32)
            st.allowed = st.allowed[: self.max_allowed_tokens]
        st.processors = (st.has_penalties or st.bias_ids.size > 0 or st.stop_ids.size > 0
                         or bool(st.bad_words) or st.allowed is not None)
        return st

    def remove_request(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._history.discard(req_id)
        self._rows.remove(req_id)

    def append_output(self, req_id: str, token_id: int) -> None:
        st = self._reqs[req_id]
        self._rows.num_output[self._rows.slot(req_id)] += 1
        self._record_token(st, token_id)

    def count_outputs(self, req_ids: Sequence[str], counts: np.ndarray | None = None) -> None:
        """A step sampled one token (or counts[i]) for each of these distinct requests (values
        not known yet: record_tokens follows). The counts move the random streams on."""
        self._rows.num_output[self._rows.slots(req_ids)] += 1 if counts is None else counts.astype(np.uint64)

    def record_tokens(self, req_ids: Sequence[str], token_ids: Sequence[int] | np.ndarray) -> None:
        """The tokens count_outputs counted: Python work only for requests whose processors
        read their history (penalties, min_tokens, bad words)."""
        history = self._history
        if not history:  # the usual batch: one set check, no loop
            return
        if isinstance(token_ids, np.ndarray):
            token_ids = token_ids.tolist()
        for req_id, tok in zip(req_ids, token_ids):
            if req_id in history:
                self._record_token(self._reqs[req_id], tok)

    def _record_token(self, st: _ReqState, token_id: int) -> None:
        st.num_output += 1
        if st.has_penalties:
            self._pen_add(st, int(token_id), 1)
        if st.tail_len:
            st.tail.append(int(token_id))
            if len(st.tail) > 4 * st.tail_len + 16:  # amortized trim
                del st.tail[:-st.tail_len]

    def append_outputs(self, req_id: str, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            self.append_output(req_id, t)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def _pen_add(self, st: _ReqState, token: int, count: int) -> None:
        slot = st.pen_slot.get(token)
        if slot is None:
            # In-vocab tokens of one sequence never outnumber the row (min(max_model_len, V)).
            if not 0 <= token < self.vocab_size or st.num_pen >= self.penalty_width:
                return
            slot = st.num_pen
            st.pen_slot[token] = slot
            st.pen_ids[slot] = token
            st.num_pen += 1
        st.pen_counts[slot] += count

    # ------------------------------------------------------------ per step

    def variants(self) -> tuple[SamplerVariant, ...]:
        """Every variant build() can return: warm each up per row bucket (see dummy_metadata)."""
        return self._variants

    def variant_of(self, req_ids: Sequence[str]) -> SamplerVariant:
        """The cheapest of `variants()` that covers what these requests need: compute it once
        per step and pass it to build()."""
        ids, version, variant = self._last_variant
        if version == self._rows.version and req_ids == ids:  # the same rows as the last step
            return variant
        need = self._rows.need[self._rows.slots(req_ids)].any(axis=0)
        variant = covering_variant(SamplerVariant(*map(bool, need)), self._variants)
        self._last_variant = (list(req_ids), self._rows.version, variant)
        return variant

    def build(self, req_ids: Sequence[str], num_rows: int,
              variant: SamplerVariant | None = None) -> SamplingMetadata:
        """Metadata for `req_ids` (rows in that order) padded to `num_rows` neutral rows.

        `variant` must cover the rows (variant_of's answer or a larger one); None computes it.
        """
        return self.build_host(req_ids, num_rows, variant).to_device()

    def dummy_metadata(self, num_rows: int, variant: SamplerVariant) -> SamplingMetadata:
        """All-padding metadata of a given variant, for warm-up compiles."""
        return self.build([], num_rows, variant)

    def build_host(self, req_ids: Sequence[str], num_rows: int, variant: SamplerVariant | None = None,
                   drafts: Sequence[Sequence[int]] | None = None) -> HostArrays:
        """drafts (speculative engines): per request, the draft tokens it verifies; it gets one
        row more per draft (sample/spec_rows.py)."""
        spec = SpecRows.of(drafts) if drafts is not None else None
        n = len(req_ids) if spec is None else spec.num_rows
        if n > num_rows:
            raise ValueError(f"{n} sampled rows do not fit in {num_rows} rows")
        if variant is None:
            variant = self.variant_of(req_ids)
        plain = n == len(req_ids)  # no drafts to verify: the last step's rows may be reused
        ids, version, last = self._last_host
        if (plain and last is not None and version == self._rows.version and last.num_rows == num_rows
                and last.variant == variant and req_ids == ids):
            # The same rows as the last step: only the random rows' uniforms move on (processor
            # rows read their history and constrained steps fill a mask: never reused).
            if not variant.random:
                return last
            idx = self._rows.slots(req_ids)
            return HostArrays({**last.fields, "uniform": self._uniforms(idx, self._rows.num_output[idx], num_rows, True)},
                              variant, self.max_logprobs, self.num_candidates, last.spec_rows)
        r, v = num_rows, self.vocab_size
        # Greedy and padding rows: temperature 1, no filters, min_p = 1 (only the max survives)
        # with the smallest uniform (the first max: jnp.argmax's tie rule). In a random batch
        # they go through the draw too: a separate argmax pass in the same program costs
        # XLA:CPU ~4x at 64 x 49152.
        f: dict[str, np.ndarray] = {
            "temperature": np.ones(r, np.float32), "top_k": np.zeros(r, np.int32),
            "top_p": np.ones(r, np.float32), "min_p": np.ones(r, np.float32),
            "uniform": np.full(r, _MIN_UNIFORM, np.float32)}
        if n:
            rows, idx = self._rows, self._rows.slots(req_ids)
            steps = rows.num_output[idx]
            if spec is not None:  # a draft's row draws what that output position would draw
                idx = np.repeat(idx, spec.per)
                steps = rows.num_output[idx] + spec.offset.astype(np.uint64)
            for name in ("temperature", "top_k", "top_p", "min_p"):
                f[name][:n] = getattr(rows, name)[idx]
            f["uniform"] = self._uniforms(idx, steps, r, variant.random)
        if variant.processors:
            states = [self._reqs[q] for q in req_ids]
            if spec is not None:
                states = [t for st, d in zip(states, spec.drafts)
                          for t in (states_after_drafts(st, d, self._record_token) if st.processors
                                    else [st] * (1 + len(d)))]
            fill_processor_fields(f, states, r, v, self.penalty_width, self.max_bias_tokens,
                                  self.max_allowed_tokens)
        if self.speculative:
            f.update(neutral_draft_fields(r))
            if spec is not None:
                spec.fill_draft_fields(f)
        if variant.structured:  # every token allowed; the runner fills the constrained rows
            f["bitmask"] = np.full((r, bitmask_width(v)), -1, np.int32)
        host = HostArrays(f, variant, self.max_logprobs, self.num_candidates, spec)
        cacheable = n and plain and not (variant.processors or variant.structured)
        self._last_host = (list(req_ids), self._rows.version, host) if cacheable else ((), -1, None)
        return host

    def _uniforms(self, idx: np.ndarray, steps: np.ndarray, num_rows: int, random: bool) -> np.ndarray:
        """[num_rows] this step's uniforms: row_uniforms for the sampling rows at slots idx (their
        output positions: steps), the smallest for greedy and padding rows (all unless `random`)."""
        u = np.full(num_rows, _MIN_UNIFORM, np.float32)
        if not random:
            return u
        rows = self._rows
        u[:len(idx)] = np.where(rows.greedy[idx], _MIN_UNIFORM, row_uniforms(rows.stream[idx], steps))
        return u
