"""Scheduler.update_from_output over arrays: a step's tokens applied to the batch at once.

Per step: advance computed counts, register newly full blocks in the prefix cache, append the
sampled tokens, check EOS / stop ids / max_tokens / max_model_len for every new token, truncate
after the first stop, and build the step's EngineCoreOutputBatch. The checks are numpy over all
new tokens (several per request under speculative decoding); gathering and writing the
requests' fields goes through `map` over attribute getters and setters, so the interpreter runs
no bytecode per request. Python loops run only over the requests that finish, that fill a KV
block (once per block_size tokens), that get their first token, and the rare ones (failed,
grammar-terminated, prompt logprobs).
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

import numpy as np

from jaxlm.core import decode_update
from jaxlm.core.outputs import EngineCoreOutputBatch, LogprobsLists, ModelRunnerOutput
from jaxlm.core.request import Request, RequestStatus
from jaxlm.core.sched_output import SchedulerOutput

# The request fields both update paths read (one set of getters, in decode_update).
_repeat, _status, _computed = decode_update._repeat, decode_update._status, decode_update._computed
_all_tokens, _outputs, _max_tokens = decode_update._all_tokens, decode_update._outputs, decode_update._max_tokens
_stop_ids, _eos = decode_update._stop_ids, decode_update._eos
_params = operator.attrgetter("sampling_params")
_min_tokens = operator.attrgetter("min_tokens")
_ignore_eos = operator.attrgetter("ignore_eos")


def gather(getter, items: list, dtype=np.int64) -> np.ndarray:
    return np.fromiter(map(getter, items), dtype, len(items))


def set_all(items: list, name: str, values: list) -> None:
    """items[i].name = values[i], without a Python loop."""
    list(map(setattr, items, _repeat(name), values))


def update_from_output(sched: Any, so: SchedulerOutput, mro: ModelRunnerOutput) -> EngineCoreOutputBatch:
    """`sched`: the Scheduler (its requests, KV cache manager and batch hooks); not imported
    here, so the scheduler alone depends on this module."""
    # The usual decode step, without numpy; not a step that verified drafts or proposed some
    # (speculative decoding: rollback and the next drafts are the array path's).
    if not so.scheduled_spec_decode_tokens and mro.spec_token_ids is None:
        fast = decode_update.try_update(sched, so, mro)
        if fast is not None:
            return fast
    pending, sched._pending_outputs = sched._pending_outputs, []
    ids = list(so.num_scheduled_tokens)
    reqs = list(map(sched.requests.get, ids))
    n_sched = np.fromiter(so.num_scheduled_tokens.values(), np.int64, len(ids))
    if None in reqs:  # aborted while the step ran
        keep = [r is not None for r in reqs]
        ids, reqs, n_sched = list(itertools.compress(ids, keep)), list(itertools.compress(reqs, keep)), n_sched[keep]
    statuses = gather(_status, reqs)
    takes = sched._takes_output_mask(statuses)
    if not takes.all():  # finished (or, sync, preempted) while the step ran
        ids, reqs, n_sched = list(itertools.compress(ids, takes)), list(itertools.compress(reqs, takes)), n_sched[takes]
        statuses = statuses[takes]
    return _Step(sched, mro, ids, reqs, n_sched, statuses, so.scheduled_spec_decode_tokens).run(pending)


class _Step:
    """One update: arrays over the step's requests (index i) and their new tokens (index j)."""

    def __init__(self, sched: Any, mro: ModelRunnerOutput, ids: list[str], reqs: list[Request],
                 n_sched: np.ndarray, statuses: np.ndarray, spec_tokens: dict[str, list[int]]) -> None:
        self.sched, self.mro, self.ids, self.reqs = sched, mro, ids, reqs
        self.n_sched, self.statuses, self.spec_tokens = n_sched, statuses, spec_tokens
        n = len(ids)
        self.row = row = np.fromiter(map(mro.req_id_to_index.get, ids, _repeat(-1)), np.int64, n)
        num_sampled = np.append(np.asarray(mro.num_sampled, np.int64), 0)  # row -1: not in the output
        self.count = num_sampled[row]
        self.start = (np.cumsum(num_sampled) - num_sampled)[row]  # its tokens' start in mro.sampled_flat
        self.failed = np.zeros(n, bool)
        if mro.failed_req_ids:
            self.failed = np.fromiter(map(mro.failed_req_ids.__contains__, ids), bool, n)

    def run(self, pending: list) -> EngineCoreOutputBatch:
        sched, reqs = self.sched, self.reqs
        sched._advance_computed_batch(reqs, self.n_sched)
        if self.spec_tokens:  # speculative decoding: rejected drafts' positions roll back
            sched.spec.roll_back(reqs, self.ids, self.spec_tokens, self.count, ~self.failed)
        computed = gather(_computed, reqs)
        num_tokens = np.fromiter(map(len, map(_all_tokens, reqs)), np.int64, len(reqs))
        ok = ~self.failed
        self._cache_blocks(np.minimum(computed, num_tokens), ok)
        count = np.where(ok, self.count, 0)
        sched._tokens_arrived_batch(reqs, count > 0)
        count[sched._partial_mask(computed, num_tokens)] = 0  # a prefill chunk's token is no sample
        finished: dict[int, tuple[RequestStatus, int | None]] = {}
        kept_pos, kept_count = self._append_tokens(count, num_tokens, finished)
        for i in np.flatnonzero(self.failed).tolist():
            finished[i] = (RequestStatus.FINISHED_ERROR, None)  # its blocks stay out of the prefix cache
        for rid in self.mro.grammar_terminated_req_ids:
            i = self.index_of.get(rid)
            if i is not None and kept_count[i]:
                # The constrained output is complete: "stop", even over ignore_eos/min_tokens/length.
                finished[i] = (RequestStatus.FINISHED_STOPPED, finished.get(i, (None, None))[1])
        for i, (status, stop_reason) in finished.items():
            reqs[i].status = status
            if stop_reason is not None:
                reqs[i].stop_reason = stop_reason
        if sched.spec is not None:  # drafts proposed after this step's tokens
            sched.spec.take_drafts(reqs, self.row, self.mro.spec_token_ids)
        out = self._build(kept_pos, kept_count, finished, pending)
        if finished:
            was_preempted = [reqs[i] for i in finished if self.statuses[i] == RequestStatus.PREEMPTED]
            sched._remove_finished([reqs[i] for i in finished], was_preempted)
        return out

    def _cache_blocks(self, cached_upto: np.ndarray, ok: np.ndarray) -> None:
        """Register the blocks that became full and computed (the few requests that fill one)."""
        kv = self.sched.kv_cache_manager
        if not kv.enable_caching:
            return
        registered = np.fromiter(map(kv.num_cached_block.get, self.ids, _repeat(0)), np.int64, len(self.ids))
        for i in np.flatnonzero(ok & (cached_upto // kv.block_size > registered)).tolist():
            kv.cache_blocks(self.reqs[i], int(cached_upto[i]))

    def _append_tokens(self, count: np.ndarray, num_tokens: np.ndarray,
                       finished: dict) -> tuple[np.ndarray, np.ndarray]:
        """Check every new token, append those up to each request's first stop; returns their
        positions in mro.sampled_flat and how many each request kept."""
        has = np.flatnonzero(count)
        if not len(has):
            return np.zeros(0, np.int64), np.zeros(len(count), np.int64)
        c = count[has]
        one_each = int(c.sum()) == len(has)  # the usual step: no array per token needed
        if one_each:
            tok_req, k = np.arange(len(has)), 0
            cum = tok_req + 1
        else:
            tok_req = np.repeat(np.arange(len(has)), c)  # j -> position in `has`
            cum = np.cumsum(c)
            k = np.arange(len(tok_req)) - (cum - c)[tok_req]  # j's position among its request's new tokens
        pos = self.start[has][tok_req] + k
        tokens = self.mro.sampled_flat[pos]
        sub = [self.reqs[i] for i in has.tolist()] if len(has) < len(self.reqs) else self.reqs
        params = list(map(_params, sub))
        n_out = np.fromiter(map(len, map(_outputs, sub)), np.int64, len(sub))
        produced = (n_out[tok_req] + k + 1)  # the output count once token j is appended
        min_tokens = gather(_min_tokens, params)[tok_req]
        eos_ids = list(map(_eos, sub))
        eos = np.array([-1 if e is None else e for e in eos_ids] if None in eos_ids else eos_ids, np.int64)
        eos[gather(_ignore_eos, params, bool)] = -1
        eos_hit = (produced >= min_tokens) & (tokens == eos[tok_req])
        stop_hit = (produced >= min_tokens) & _in_stop_ids(tokens, tok_req, list(map(_stop_ids, sub)))
        length_hit = ((produced >= gather(_max_tokens, sub)[tok_req])
                      | (num_tokens[has][tok_req] + k + 1 >= self.sched.max_model_len))
        ends = np.flatnonzero(eos_hit | stop_hit | length_hit)
        keep = np.ones(len(tokens), bool)
        if len(ends):
            first_req, first = (ends, np.arange(len(ends))) if one_each else np.unique(tok_req[ends], return_index=True)
            for r, j in zip(first_req.tolist(), ends[first].tolist()):
                keep[j + 1:cum[r]] = False  # tokens after the stop are dropped
                stop_reason = int(tokens[j]) if stop_hit[j] and not eos_hit[j] else None
                status = (RequestStatus.FINISHED_STOPPED if eos_hit[j] or stop_hit[j]
                          else RequestStatus.FINISHED_LENGTH_CAPPED)
                finished[int(has[r])] = (status, stop_reason)
        if one_each:  # a stop keeps its own token: nothing is dropped
            kept_count, kept_tokens = count, tokens.tolist()
        else:
            kept_count = np.zeros(len(count), np.int64)
            kept_count[has] = np.bincount(tok_req[keep], minlength=len(has))
            kept_tokens = tokens[keep].tolist()
        if len(kept_tokens) == len(sub):  # one token each: the usual decode step
            list(map(list.append, map(_outputs, sub), kept_tokens))
            list(map(list.append, map(_all_tokens, sub), kept_tokens))
        else:
            ends_k = np.cumsum(kept_count[has]).tolist()
            pieces = [kept_tokens[e - n:e] for e, n in zip(ends_k, kept_count[has].tolist())]
            list(map(list.extend, map(_outputs, sub), pieces))
            list(map(list.extend, map(_all_tokens, sub), pieces))
        return (pos if one_each else pos[keep]), kept_count

    def _build(self, kept_pos: np.ndarray, kept_count: np.ndarray, finished: dict,
               pending: list) -> EngineCoreOutputBatch:
        mro, reqs, ids = self.mro, self.reqs, self.ids
        has_output = kept_count > 0
        has_output[list(finished)] = True
        prompt_lps = {self.index_of[rid]: lp for rid, lp in mro.prompt_logprobs.items() if rid in self.index_of}
        has_output[list(prompt_lps)] = True
        sel = np.flatnonzero(has_output).tolist()
        out = EngineCoreOutputBatch.from_outputs(pending) if pending else EngineCoreOutputBatch()
        base = len(out.req_ids)
        out.req_ids = out.req_ids + ([ids[i] for i in sel] if len(sel) < len(ids) else ids)
        out.num_new_tokens = np.concatenate([out.num_new_tokens, kept_count[sel]]).astype(np.int32)
        out.new_token_ids = np.concatenate([out.new_token_ids, mro.sampled_flat[kept_pos]]).astype(np.int32)
        if mro.logprobs is not None and len(kept_pos):  # pending outputs carry no tokens, so no rows
            lp = mro.logprobs
            out.new_logprobs = LogprobsLists(lp.token_ids[kept_pos], lp.logprobs[kept_pos], lp.ranks[kept_pos])
        where = {i: base + o for o, i in enumerate(sel)} if (finished or prompt_lps) else {}
        for i, (status, _) in finished.items():
            out.finish_reasons[where[i]] = RequestStatus.get_finished_reason(status)
            if reqs[i].stop_reason is not None:
                out.stop_reasons[where[i]] = reqs[i].stop_reason
        for i, lp in prompt_lps.items():
            out.new_prompt_logprobs[where[i]] = lp
        # First tokens (or an output without any): the request's prefix hit and scheduled time.
        sel_reqs = [reqs[i] for i in sel] if len(sel) < len(reqs) else reqs
        n_out = np.fromiter(map(len, map(_outputs, sel_reqs)), np.int64, len(sel))
        for o in np.flatnonzero(n_out == kept_count[sel]).tolist():
            req = sel_reqs[o]
            out.num_cached_tokens[base + o] = max(req.num_cached_tokens, 0)
            if req.scheduled_ts is not None:
                out.scheduled_ts[base + o] = req.scheduled_ts
        return out

    @functools.cached_property
    def index_of(self) -> dict[str, int]:
        """req_id -> i (built only for the rare per-request extras)."""
        return dict(zip(self.ids, range(len(self.ids))))


def _in_stop_ids(tokens: np.ndarray, tok_req: np.ndarray, stop_sets: list[frozenset]) -> np.ndarray:
    """tokens[j] in stop_sets[tok_req[j]], with one np.isin per distinct set (requests share them)."""
    hit = np.zeros(len(tokens), bool)
    codes: dict[frozenset, int] = {}
    code = np.fromiter(map(codes.setdefault, stop_sets, itertools.count()), np.int64, len(stop_sets))
    for stop_set, c in codes.items():
        if stop_set:
            mask = code[tok_req] == c
            ids = np.fromiter(stop_set, np.int64, len(stop_set))
            # A few ids: one broadcast compare (np.isin's set-up costs more at these sizes).
            hit[mask] = ((tokens[mask, None] == ids).any(1) if len(ids) <= 64 else np.isin(tokens[mask], ids))
    return hit
