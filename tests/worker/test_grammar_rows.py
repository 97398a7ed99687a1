"""GrammarRows with reasoning_end_token_ids: free decoding until the end id, then the grammar
(masking and advancing), and the same state rebuilt by replaying the outputs."""

from __future__ import annotations

import numpy as np
import pytest

from jaxlm.structured_output.bitmask import allowed_token_ids
from jaxlm.structured_output.params import StructuredOutputsParams
from jaxlm.worker.grammar_rows import GrammarRows
from tests.structured_output.so_helpers import MODEL_VOCAB, tiny_bpe_tokenizer


@pytest.fixture(scope="module")
def rows_and_tokenizer(tmp_path_factory):
    from jaxlm.structured_output.manager import StructuredOutputManager

    tok = tiny_bpe_tokenizer(tmp_path_factory.mktemp("gr_tok"))
    rows = GrammarRows()
    rows.manager = StructuredOutputManager(tok, MODEL_VOCAB, num_threads=1)
    return rows, tok


def _mask(rows: GrammarRows, req_ids: list[str]) -> np.ndarray:
    fields = {"bitmask": rows.manager.allocate_bitmask(len(req_ids))}
    rows.fill_bitmask(fields, req_ids)
    return fields["bitmask"]


def test_constraint_starts_after_the_reasoning_end_token(rows_and_tokenizer):
    rows, tok = rows_and_tokenizer
    end_id = tok.convert_tokens_to_ids("</s>") + 100  # any id; the tiny vocab has no </think>
    params = StructuredOutputsParams(choice=["yes", "no"], reasoning_end_token_ids=[end_id])
    free = tok.encode("The quick brown fox", add_special_tokens=False)
    rows.add_request("r", params, [])
    rows.add_request("plain", StructuredOutputsParams(choice=["yes", "no"]), [])
    assert rows.is_reasoning("r") and not rows.is_reasoning("plain")
    mask = _mask(rows, ["r", "plain"])
    assert (mask[0] == -1).all() and not (mask[1] == -1).all()
    assert rows.advance({"r": free[0]}) == set() and rows.advance({"r": free[1]}) == set()
    assert rows.advance({"r": end_id}) == set() and not rows.is_reasoning("r")
    allowed = set(allowed_token_ids(_mask(rows, ["r"])[0], MODEL_VOCAB))
    yes = tok.encode("yes", add_special_tokens=False)
    assert yes[0] in allowed and free[0] not in allowed
    done = set()
    for t in yes:
        done = rows.advance({"r": t})
    assert done == {"r"}

    # Replaying the outputs (a matcher rebuilt after preemption) gives the same state.
    replayed = GrammarRows()
    replayed.manager = rows.manager
    replayed.add_request("r", params, [free[0], end_id, *yes[:-1]])
    assert not replayed.is_reasoning("r")
    assert replayed.advance({"r": yes[-1]}) == {"r"}
    replayed.add_request("s", params, free)
    assert replayed.is_reasoning("s") and (_mask(replayed, ["s"])[0] == -1).all()
    replayed.finish_request("s")
    assert not replayed.is_reasoning("s")
