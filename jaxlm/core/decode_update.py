"""update_from_output's usual step without numpy: every request decodes one token.

A step in which each scheduled request sampled exactly one token, in the runner's order, with
nothing failed, no grammar ending, no prompt logprobs and no first token (the steady state of
decoding) is applied here with C-level `map`s over Python lists: append the tokens, then find
the few requests that may end (EOS, stop ids, max_tokens, max_model_len) and decide those in a
loop over them alone. numpy's cost per call (~1-2 us in a step, dozens of calls) outweighed the
work below a few hundred requests; measured against the array path in PERF_NOTES (2026-11-26).
Anything else returns None and goes through core/step_update.py's array path, which handles
several tokens per request (speculative decoding), prompt chunks and the rare extras; both
give the same result (tests/core/test_decode_update.py compares them step by step).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np

from jaxlm.core.outputs import EngineCoreOutputBatch, ModelRunnerOutput
from jaxlm.core.request import RequestStatus
from jaxlm.core.sched_output import SchedulerOutput

_repeat, _compress = itertools.repeat, itertools.compress
_status = operator.attrgetter("status")
_computed = operator.attrgetter("num_computed_tokens")
_all_tokens = operator.attrgetter("all_token_ids")
_outputs = operator.attrgetter("output_token_ids")
_max_tokens = operator.attrgetter("max_tokens")
_stop_ids = operator.attrgetter("stop_token_ids")
_eos = operator.attrgetter("eos_token_id")
_RUNNING = RequestStatus.RUNNING
_STOPPED, _LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED


class DecodeBatch:
    """The requests of the last decode step and what does not change while they run (their
    token lists, the tokens that may end one of them, their max_tokens): consecutive steps of
    one batch reuse it instead of gathering them again (the scheduler holds it)."""

    def __init__(self, sched: Any, ids: list[str]) -> None:
        self.ids = list(ids)
        self.reqs = list(map(sched.requests.get, ids))
        self.ok = None not in self.reqs
        if not self.ok:
            return
        self.outs = list(map(_outputs, self.reqs))
        self.alls = list(map(_all_tokens, self.reqs))
        self.max_tokens = list(map(_max_tokens, self.reqs))
        # Any request's EOS or stop ids: a token outside ends no request (a superset: the
        # rules, ignore_eos and min_tokens among them, run for the few tokens inside).
        self.end_tokens = set().union(*map(_stop_ids, self.reqs), map(_eos, self.reqs))


def try_update(sched: Any, so: SchedulerOutput, mro: ModelRunnerOutput) -> EngineCoreOutputBatch | None:
    """The step's EngineCoreOutputBatch, or None (nothing changed) when the step is not a plain
    decode step. `sched`: the Scheduler (its requests, KV cache manager, `_decode_batch` and
    the hook `_one_token_arrived`)."""
    ids = mro.req_ids
    n = len(ids)
    if (not n or sched._pending_outputs or mro.failed_req_ids or mro.grammar_terminated_req_ids
            or mro.prompt_logprobs or len(mro.sampled_flat) != n or len(so.num_scheduled_tokens) != n
            or ids != list(so.num_scheduled_tokens) or not mro.num_sampled.all()):
        return None  # (every count >= 1 and n tokens in all: one each)
    batch = sched._decode_batch
    if batch is None or ids != batch.ids:
        batch = sched._decode_batch = DecodeBatch(sched, ids)
    if not batch.ok:
        return None  # aborted while the step ran
    reqs, outs, alls = batch.reqs, batch.outs, batch.alls
    if list(map(_status, reqs)).count(_RUNNING) != n:
        return None  # finished or preempted while the step ran
    if not all(outs):
        return None  # a first token: the array path adds the prefix hit and scheduled time
    if not sched._one_token_arrived(reqs, so.num_scheduled_tokens.values()):
        return None
    _cache_blocks(sched.kv_cache_manager, ids, reqs, alls)
    tokens = mro.sampled_flat.tolist()
    # One token each and a stop keeps its own token: every token is appended.
    list(map(list.append, outs, tokens))
    list(map(list.append, alls, tokens))
    out = EngineCoreOutputBatch(ids, np.ones(n, np.int32), mro.sampled_flat.astype(np.int32, copy=False),
                                mro.logprobs)
    finished = _finishing(sched.max_model_len, batch, tokens)
    for i, (status, stop_reason) in finished.items():
        reqs[i].status = status
        out.finish_reasons[i] = RequestStatus.get_finished_reason(status)
        if stop_reason is not None:
            reqs[i].stop_reason = stop_reason
        if reqs[i].stop_reason is not None:
            out.stop_reasons[i] = reqs[i].stop_reason
    if finished:
        sched._remove_finished([reqs[i] for i in finished], [])
    return out


def _cache_blocks(kv: Any, ids: list[str], reqs: list, alls: list[list[int]]) -> None:
    """Register the blocks that became full and computed (before this step's tokens are appended).
    A block fills at min(computed, known tokens); the known tokens alone find the candidates
    (a superset: a few requests every block_size steps), the exact bound is checked for them."""
    if not kv.enable_caching:
        return
    bs, registered = kv.block_size, kv.num_cached_block
    full = map(operator.floordiv, map(len, alls), _repeat(bs))
    for i in _compress(range(len(ids)), map(operator.gt, full, map(registered.get, ids, _repeat(0)))):
        upto = min(reqs[i].num_computed_tokens, len(alls[i]))
        if upto // bs > registered.get(ids[i], 0):
            kv.cache_blocks(reqs[i], upto)


def _finishing(max_model_len: int, batch: DecodeBatch, tokens: list[int]) -> dict[int, tuple[RequestStatus, int | None]]:
    """i -> (finished status, stop token or None) for the requests this step's token ends; the
    candidates come from C-level checks over the batch, the rules run only for them."""
    n, reqs, outs = len(tokens), batch.reqs, batch.outs
    maybe = set(_compress(range(n), map(batch.end_tokens.__contains__, tokens)))
    # max_tokens also finds the max_model_len ends: admission keeps prompt + max_tokens within it.
    maybe.update(_compress(range(n), map(operator.ge, map(len, outs), batch.max_tokens)))
    finished = {}
    for i in sorted(maybe):
        req, tok = reqs[i], tokens[i]
        params = req.sampling_params
        produced = len(outs[i])
        past_min = produced >= params.min_tokens
        eos_hit = past_min and not params.ignore_eos and req.eos_token_id is not None and tok == req.eos_token_id
        stop_hit = past_min and tok in req.stop_token_ids
        if eos_hit or stop_hit:
            finished[i] = (_STOPPED, tok if stop_hit and not eos_hit else None)
        elif produced >= req.max_tokens or len(batch.alls[i]) >= max_model_len:
            finished[i] = (_LENGTH, None)
    return finished
