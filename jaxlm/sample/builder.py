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

from jaxlm.sample.metadata import ALL_VARIANTS, HostArrays, SamplerVariant, SamplingMetadata
from jaxlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_M64 = (1 << 64) - 1


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIN_UNIFORM = np.float32(1.0 / (1 << 24))  # smallest value row_uniforms returns


def _stable_hash64(text: str) -> int:
    # Python's hash() is salted per process; the stream of an unseeded request must not be.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


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
    num_output: int = 0
    processors: bool = False
    # penalties: distinct prompt+output tokens and their output counts
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


class SamplingInputBuilder:
    """Per-request sampling state on the host; `build()` makes a step's SamplingMetadata.

    vocab_size: the logits' last dimension. max_model_len bounds the distinct tokens of a
    sequence (penalty row width). max_bias_tokens / max_allowed_tokens are the fixed widths of
    the sparse logit_bias(+bans) and allowed_token_ids rows; larger requests are rejected.
    """

    def __init__(self, vocab_size: int, max_model_len: int, *, engine_seed: int = 0,
                 max_logprobs: int = 20, max_bias_tokens: int = 1024,
                 max_allowed_tokens: int = 1024, num_candidates: int = 256) -> None:
        self.vocab_size = vocab_size
        self.penalty_width = max(1, min(max_model_len, vocab_size))
        self.engine_seed = engine_seed
        self.max_logprobs = max_logprobs
        self.max_bias_tokens = max_bias_tokens
        self.max_allowed_tokens = max_allowed_tokens
        self.num_candidates = num_candidates
        self._reqs: dict[str, _ReqState] = {}

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
        """Register a request (again after preemption: pass the outputs so far)."""
        self.check_params(params)
        if params.seed is not None:
            stream = int(_mix64(np.array([params.seed & _M64], np.uint64))[0])
        else:
            # Engine seed mixed with the request id: distinct per request, and a preempted,
            # re-added request continues the same stream.
            stream = _stable_hash64(f"engine:{self.engine_seed & _M64}:{req_id}")
        st = _ReqState(params=params, stream=stream)
        st.has_penalties = (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                            or params.repetition_penalty != 1.0)
        if st.has_penalties:
            st.pen_ids = np.full(self.penalty_width, self.vocab_size, np.int32)
            st.pen_counts = np.zeros(self.penalty_width, np.int32)
            for t in prompt_token_ids:
                self._pen_add(st, int(t), 0)
        if params.logit_bias:
            st.bias_ids = np.fromiter(params.logit_bias.keys(), np.int32)
            st.bias_vals = np.fromiter(params.logit_bias.values(), np.float32)
        if params.min_tokens:
            st.stop_ids = np.array(sorted(params.all_stop_token_ids), np.int32)
        if params.bad_words_token_ids:
            st.bad_words = [(tuple(w[:-1]), int(w[-1])) for w in params.bad_words_token_ids]
            st.tail_len = max(len(w) for w in params.bad_words_token_ids) - 1
        if params.allowed_token_ids is not None:
            st.allowed = np.array(sorted(set(params.allowed_token_ids)), np.int32)
        st.processors = (st.has_penalties or st.bias_ids.size > 0 or st.stop_ids.size > 0
                         or bool(st.bad_words) or st.allowed is not None)
        self._reqs[req_id] = st
        for t in output_token_ids:
            self.append_output(req_id, t)

    def remove_request(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def append_output(self, req_id: str, token_id: int) -> None:
        st = self._reqs[req_id]
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
            if st.num_pen >= self.penalty_width:
                raise ValueError("more distinct tokens than max_model_len; builder misconfigured")
            slot = st.num_pen
            st.pen_slot[token] = slot
            st.pen_ids[slot] = token
            st.num_pen += 1
        st.pen_counts[slot] += count

    # ------------------------------------------------------------ per step

    @staticmethod
    def variants() -> tuple[SamplerVariant, ...]:
        """Every variant build() can return: warm each up per row bucket (see dummy_metadata)."""
        return ALL_VARIANTS

    def variant_of(self, req_ids: Sequence[str]) -> SamplerVariant:
        states = [self._reqs[r] for r in req_ids]
        sampling = [s for s in states if not s.params.greedy]
        return SamplerVariant(
            random=bool(sampling),
            filters=any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in sampling),
            processors=any(s.processors for s in states),
            logprobs=any(s.params.logprobs is not None for s in states))

    def build(self, req_ids: Sequence[str], num_rows: int,
              min_variant: SamplerVariant | None = None) -> SamplingMetadata:
        """Metadata for `req_ids` (rows in that order) padded to `num_rows` neutral rows."""
        return self.build_host(req_ids, num_rows, min_variant).to_device()

    def dummy_metadata(self, num_rows: int, variant: SamplerVariant) -> SamplingMetadata:
        """All-padding metadata of a given variant, for warm-up compiles."""
        return self.build([], num_rows, variant)

    def build_host(self, req_ids: Sequence[str], num_rows: int,
                   min_variant: SamplerVariant | None = None) -> HostArrays:
        n = len(req_ids)
        if n > num_rows:
            raise ValueError(f"{n} requests do not fit in {num_rows} rows")
        states = [self._reqs[r] for r in req_ids]
        need = self.variant_of(req_ids)
        if min_variant is not None:
            need = SamplerVariant(*(a or b for a, b in zip(need, min_variant)))
            need = need._replace(random=need.random or need.filters)
        r, v = num_rows, self.vocab_size
        f: dict[str, np.ndarray] = {
            "temperature": np.ones(r, np.float32), "greedy": np.ones(r, np.bool_),
            "top_k": np.zeros(r, np.int32), "top_p": np.ones(r, np.float32),
            "min_p": np.ones(r, np.float32), "uniform": np.full(r, _MIN_UNIFORM, np.float32)}
        if n:
            greedy = np.array([s.params.greedy for s in states], np.bool_)
            f["greedy"][:n] = greedy
            f["temperature"][:n] = np.where(greedy, 1.0, [s.params.temperature for s in states])
            # Greedy rows skip the filters entirely (vLLM resets them for temperature 0 too).
            f["top_k"][:n] = np.where(greedy, 0, [s.params.top_k for s in states])
            f["top_p"][:n] = np.where(greedy, 1.0, [s.params.top_p for s in states])
            # In a random batch greedy rows go through the draw too, as min_p = 1 (only the max
            # survives) with the smallest uniform (the first max: jnp.argmax's tie rule). One
            # separate argmax pass in the same program costs XLA:CPU ~4x at 64 x 49152.
            f["min_p"][:n] = np.where(greedy, 1.0, [s.params.min_p for s in states])
            u = row_uniforms(np.array([s.stream for s in states], np.uint64),
                             np.array([s.num_output for s in states], np.uint64))
            f["uniform"][:n] = np.where(greedy, _MIN_UNIFORM, u)
        if need.processors:
            self._fill_processors(f, states, r, v)
        return HostArrays(f, need, self.max_logprobs, self.num_candidates)

    def _fill_processors(self, f: dict[str, np.ndarray], states: list[_ReqState], r: int, v: int) -> None:
        f["presence_penalty"] = np.zeros(r, np.float32)
        f["frequency_penalty"] = np.zeros(r, np.float32)
        f["repetition_penalty"] = np.ones(r, np.float32)
        f["pen_ids"] = np.full((r, self.penalty_width), v, np.int32)
        f["pen_counts"] = np.zeros((r, self.penalty_width), np.int32)
        f["bias_ids"] = np.full((r, self.max_bias_tokens), v, np.int32)
        f["bias_vals"] = np.zeros((r, self.max_bias_tokens), np.float32)
        f["allowed_ids"] = np.full((r, self.max_allowed_tokens), v, np.int32)
        f["has_allowed"] = np.zeros(r, np.bool_)
        for i, st in enumerate(states):
            if not st.processors:
                continue
            p = st.params
            if st.has_penalties:
                f["presence_penalty"][i] = p.presence_penalty
                f["frequency_penalty"][i] = p.frequency_penalty
                f["repetition_penalty"][i] = p.repetition_penalty
                k = st.num_pen
                f["pen_ids"][i, :k] = st.pen_ids[:k]
                f["pen_counts"][i, :k] = st.pen_counts[:k]
            nb = st.bias_ids.size
            f["bias_ids"][i, :nb] = st.bias_ids
            f["bias_vals"][i, :nb] = st.bias_vals
            bans = self._banned(st)
            if bans:
                f["bias_ids"][i, nb:nb + len(bans)] = bans
                f["bias_vals"][i, nb:nb + len(bans)] = -np.inf
            if st.allowed is not None:
                f["allowed_ids"][i, :st.allowed.size] = st.allowed
                f["has_allowed"][i] = True

    @staticmethod
    def _banned(st: _ReqState) -> list[int]:
        """Tokens banned this step: stop ids under min_tokens, bad words whose prefix matches."""
        bans: list[int] = []
        if st.stop_ids.size and st.num_output < st.params.min_tokens:
            bans.extend(st.stop_ids.tolist())
        for prefix, last in st.bad_words:
            # vLLM matches the prefix against the output tokens only.
            if not prefix:
                bans.append(last)
            elif len(prefix) <= st.num_output and tuple(st.tail[-len(prefix):]) == prefix:
                bans.append(last)
        return bans
