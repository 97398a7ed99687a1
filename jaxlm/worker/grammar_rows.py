"""The runner's structured-output state: one llguidance matcher per constrained request.

Matchers live on the host until their request finishes; a preempted request keeps its own (it
has accepted exactly its outputs so far), and one whose matcher is missing is rebuilt by
replaying its outputs. The step fills the packed bitmask rows of the constrained requests while
the device runs the body, and advances each matcher with the token sampled for it.

Reasoning models: a request whose params carry ``reasoning_end_token_ids`` decodes freely (its
row stays all -1, its matcher does not advance) until one of those ids is sampled; the matcher
starts on the token after it. Replaying outputs does the same, from the last end id.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxlm.structured_output.manager import StructuredOutputManager, StructuredOutputRequest
from jaxlm.structured_output.params import StructuredOutputsParams


def _tokens_after_reasoning(params: StructuredOutputsParams, output_token_ids: list[int]) -> list[int] | None:
    """The outputs the matcher must have accepted, or None while the reasoning goes on."""
    ends = params.reasoning_end_token_ids
    if not ends:
        return list(output_token_ids)
    last = max((i for i, t in enumerate(output_token_ids) if t in ends), default=None)
    return None if last is None else list(output_token_ids[last + 1:])


class GrammarRows:
    def __init__(self) -> None:
        # Set by the engine when the first constrained request arrives (llguidance's tokenizer
        # costs ~0.5 s, so engines that never constrain don't build it).
        self.manager: StructuredOutputManager | None = None
        self._grammars: dict[str, StructuredOutputRequest] = {}  # req_id -> matcher, until finished
        self._reasoning: dict[str, frozenset[int]] = {}  # req_id -> end ids, while it reasons

    def add_request(self, req_id: str, params: StructuredOutputsParams, output_token_ids: list[int]) -> None:
        replay = _tokens_after_reasoning(params, output_token_ids)
        kept = self._grammars.get(req_id)
        if kept is not None and (req_id in self._reasoning) == (replay is None) \
                and kept.num_accepted == len(replay or ()):
            return
        if self.manager is None:
            raise RuntimeError("a constrained request reached the runner without a StructuredOutputManager")
        self._grammars[req_id] = self.manager.new_request(params, replay or ())
        if replay is None:
            self._reasoning[req_id] = frozenset(params.reasoning_end_token_ids)
        else:
            self._reasoning.pop(req_id, None)

    def finish_request(self, req_id: str) -> None:
        self._grammars.pop(req_id, None)
        self._reasoning.pop(req_id, None)

    def is_reasoning(self, req_id: str) -> bool:
        return req_id in self._reasoning

    def fill_bitmask(self, host_fields: dict[str, np.ndarray], sample_req_ids: Sequence[str],
                     spec_rows: Any = None) -> None:
        """Mask rows of the constrained requests in the sampler's host arrays (the "bitmask" field,
        present in the variants that constrained rows select); unconstrained rows, and rows still
        reasoning, stay all -1. spec_rows (sample/spec_rows.py): a speculative step's rows."""
        if spec_rows is not None:
            self._fill_draft_rows(host_fields["bitmask"], sample_req_ids, spec_rows)
            return
        rows = [(self._grammars[r], i) for i, r in enumerate(sample_req_ids)
                if r in self._grammars and r not in self._reasoning]
        if rows:
            self.manager.fill_bitmask(host_fields["bitmask"], rows)

    def _fill_draft_rows(self, bitmask: np.ndarray, sample_req_ids: Sequence[str], spec_rows: Any) -> None:
        """Row j of a request is masked as if its drafts 1..j were accepted (the matcher advances
        over them, then rolls back); the first draft the grammar rejects leaves its row allowing
        everything, since the row before it cannot sample that draft: acceptance ends there."""
        for i, req_id in enumerate(sample_req_ids):
            grammar = self._grammars.get(req_id)
            if grammar is None:
                continue
            row, drafts = int(spec_rows.first[i]), list(spec_rows.drafts[i])
            ends = self._reasoning.get(req_id)
            if ends is not None:  # free text up to a reasoning end id among the drafts
                cut = next((j + 1 for j, t in enumerate(drafts) if t in ends), None)
                if cut is None:
                    continue
                row, drafts = row + cut, drafts[cut:]
            valid = grammar.validate_tokens(drafts)
            for j in range(valid + 1):
                grammar.fill_bitmask(bitmask, row + j)
                if j < valid:
                    grammar.accept_token(drafts[j])
            grammar.rollback(valid)

    def advance_tokens(self, req_ids: Sequence[str], token_ids: np.ndarray) -> set[str]:
        """Accept each constrained request's token (req_ids[i] sampled token_ids[i]); the ids
        whose grammar is now terminated (complete, or errored by a token it rejected: the
        request ends either way). No work for a step without constrained requests."""
        if not self._grammars:
            return set()
        return self.advance(dict(zip(req_ids, token_ids.tolist())))

    def advance_runs(self, req_ids: Sequence[str], counts: np.ndarray, token_ids: np.ndarray) -> dict[str, int]:
        """advance_many for a step's tokens back to back (req_ids[i] got counts[i] of them)."""
        if not self._grammars:
            return {}
        ends = np.cumsum(counts).tolist()
        flat = token_ids.tolist()
        return self.advance_many({r: flat[e - c:e] for r, c, e in zip(req_ids, counts.tolist(), ends)
                                  if r in self._grammars})

    def advance(self, sampled: dict[str, int]) -> set[str]:
        """Accept each constrained request's token; the ids whose grammar is now terminated
        (complete, or errored by a token it rejected: the request ends either way)."""
        return set(self.advance_many({r: (t,) for r, t in sampled.items()}))

    def advance_many(self, sampled: dict[str, Sequence[int]]) -> dict[str, int]:
        """Accept each constrained request's tokens in order (several: speculative decoding);
        for each request whose grammar terminates, how many of its tokens it took (the request
        ends with the token that terminated it: later ones are dropped)."""
        done: dict[str, int] = {}
        for req_id, tokens in sampled.items():
            grammar = self._grammars.get(req_id)
            if grammar is None:
                continue
            for n, tok in enumerate(tokens, 1):
                ends = self._reasoning.get(req_id)
                if ends is not None:
                    if tok in ends:  # the constraint starts with the next token
                        del self._reasoning[req_id]
                    continue
                grammar.accept_token(tok)
                if grammar.is_terminated():
                    done[req_id] = n
                    break
        return done
