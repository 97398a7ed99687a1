"""Streamed text is unchanged by the output path's rewrite (issue 27): every case's outputs, step
by step, equal those recorded from the output processor of commit 312e4eb (Python string
assembly per token) in tests/engine/data/stream_deltas.json.

Cases: multi-byte and emoji text (ZWJ sequences), byte-fallback tokens, random token ids
(invalid UTF-8 runs), stop strings that straddle tokens (kept and cut), min_tokens, special
tokens kept or skipped, a stop token that ends the request, and several tokens per step (1 to 4,
as speculative decoding delivers them), for DELTA, CUMULATIVE and FINAL_ONLY outputs.

The recording is the reference and is never regenerated to make a change pass:
JAXLM_RECORD_STREAM_DELTAS=1 rewrites it (only from a checkout whose output path is the one
being recorded).
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from jaxlm.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers.tiny_tokenizer import add_tiny_tokenizer
from tests.sample.tok_helpers import byte_fallback_tokenizer, smollm2_tokenizer

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stream_deltas.json")

TEXTS = [
    " Hello 🙂 世界! naïve café — 日本語のテキスト 👩‍👩‍👧 done.",
    " emoji at the end 🎉",
    " 中文 and 한국어 🇫🇷🇯🇵 ok",
]
KINDS = {"delta": RequestOutputKind.DELTA, "cumulative": RequestOutputKind.CUMULATIVE,
         "final": RequestOutputKind.FINAL_ONLY}


def _tokenizer(name: str):
    if name == "smollm2":
        return smollm2_tokenizer()
    if name == "byte_fallback":
        return byte_fallback_tokenizer()
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "jaxlm_test_tiny_bpe_tokenizer")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        add_tiny_tokenizer(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def _chunks(n: int, rng: random.Random, max_chunk: int) -> list[int]:
    sizes = []
    while n > 0:
        sizes.append(min(n, rng.randint(1, max_chunk)))
        n -= sizes[-1]
    return sizes


def _cases(tok_name: str, tok) -> list[dict]:
    """Deterministic cases for one tokenizer: (prompt ids, output ids, chunk sizes, params)."""
    rng = random.Random(f"stream-{tok_name}")
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompt = enc("Say:")
    cases = []
    for i, text in enumerate(TEXTS):
        for max_chunk in (1, 4):
            cases.append(dict(name=f"text{i}-c{max_chunk}", prompt=prompt, out=enc(text), max_chunk=max_chunk))
    vocab = len(tok)
    for i in range(3):  # random ids: byte tokens that form no valid UTF-8, mid-character cuts
        out = [rng.randrange(3, vocab) for _ in range(40)]
        cases.append(dict(name=f"random{i}", prompt=prompt, out=out, max_chunk=1 + i))
    text = " hello the world. The end is near. The end."
    for include in (False, True):
        for max_chunk in (1, 3):
            cases.append(dict(name=f"stop-straddle-inc{int(include)}-c{max_chunk}", prompt=[], out=enc(text),
                              max_chunk=max_chunk,
                              params=dict(stop=["zzz", "ld. Th"], include_stop_str_in_output=include)))
    cases.append(dict(name="stop-emoji", prompt=prompt, out=enc(TEXTS[0]), max_chunk=2,
                      params=dict(stop=["界!"])))
    cases.append(dict(name="stop-at-end", prompt=prompt, out=enc(" the end."), max_chunk=1,
                      params=dict(stop=["end."])))
    cases.append(dict(name="min-tokens", prompt=[], out=enc("stop here stop there"), max_chunk=1,
                      params=dict(stop=["stop"], min_tokens=2)))
    specials = [t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None]
    mixed = enc("Hi there") + specials[:1] + enc(" more") + specials[-1:] + enc(" 🙂")
    for skip in (True, False):
        cases.append(dict(name=f"specials-skip{int(skip)}", prompt=prompt, out=mixed, max_chunk=2,
                          params=dict(skip_special_tokens=skip)))
    ids = enc(" Hi! 🙂 bye")
    cases.append(dict(name="stop-token", prompt=prompt, out=ids, max_chunk=1, stop_token=True,
                      params=dict(stop_token_ids=[ids[-1]])))
    cases.append(dict(name="stop-token-included", prompt=prompt, out=ids, max_chunk=2, stop_token=True,
                      params=dict(stop_token_ids=[ids[-1]], include_stop_str_in_output=True)))
    for case in cases:
        case["chunks"] = _chunks(len(case["out"]), rng, case.pop("max_chunk"))
    return cases


def _run_case(tok, case: dict, kind: RequestOutputKind) -> list[list]:
    """Feed the case's tokens step by step through an OutputProcessor; per step with an output:
    [text, token_ids, finish_reason, stop_reason]."""
    from jaxlm.core.outputs import EngineCoreOutput, EngineCoreOutputBatch, FinishReason
    from jaxlm.engine.output_processor import OutputProcessor

    params = SamplingParams(max_tokens=len(case["out"]), output_kind=kind, **case.get("params", {}))
    op = OutputProcessor(tok)
    op.add_request("r", "r", None, list(case["prompt"]), params, 0.0)
    steps, start = [], 0
    for n in case["chunks"]:
        new = case["out"][start:start + n]
        start += n
        finish = stop_reason = None
        if start == len(case["out"]):
            finish = FinishReason.STOP if case.get("stop_token") else FinishReason.LENGTH
            stop_reason = new[-1] if case.get("stop_token") else None
        batch = EngineCoreOutputBatch.from_outputs([EngineCoreOutput("r", new, finish, stop_reason)])
        for _, ro in op.process_outputs(batch).routed:
            c = ro.outputs[0]
            steps.append([c.text, list(c.token_ids), c.finish_reason, c.stop_reason])
        if not op.has_unfinished_requests():
            break
    return steps


def _all_results() -> dict:
    out = {}
    for tok_name in ("smollm2", "byte_fallback", "tiny_bpe"):
        tok = _tokenizer(tok_name)
        for case in _cases(tok_name, tok):
            for kind_name, kind in KINDS.items():
                out[f"{tok_name}/{case['name']}/{kind_name}"] = _run_case(tok, case, kind)
    return out


@pytest.fixture(scope="module")
def recorded() -> dict:
    if os.environ.get("JAXLM_RECORD_STREAM_DELTAS"):
        os.makedirs(os.path.dirname(_DATA), exist_ok=True)
        with open(_DATA, "w") as f:
            json.dump(_all_results(), f, ensure_ascii=False, indent=0, sort_keys=True)
    with open(_DATA) as f:
        return json.load(f)


def _past_stop_dropped(got: list[list], want: list[list]) -> bool:
    """The one change from the recording (issue 24): a step of several tokens that completes a
    stop string ends the output at the token completing it, so greedy outputs are token for token
    those of one token a step; the recording (text and all else equal) kept the step's later ids."""
    if len(got) != len(want) or got[:-1] != want[:-1] or not isinstance(want[-1][3], str):
        return False
    (text, ids, reason, stop), (w_text, w_ids, w_reason, w_stop) = got[-1], want[-1]
    return (text, reason, stop) == (w_text, w_reason, w_stop) and 0 < len(ids) < len(w_ids) \
        and w_ids[:len(ids)] == ids


@pytest.mark.parametrize("tok_name", ["smollm2", "byte_fallback", "tiny_bpe"])
def test_stream_outputs_equal_the_recording(recorded, tok_name):
    tok = _tokenizer(tok_name)
    cases = _cases(tok_name, tok)
    assert len(cases) >= 20
    cut = 0
    for case in cases:
        for kind_name, kind in KINDS.items():
            key = f"{tok_name}/{case['name']}/{kind_name}"
            got = _run_case(tok, case, kind)
            if got != recorded[key]:
                assert _past_stop_dropped(got, recorded[key]), key
                cut += 1
    assert cut > 0 or tok_name != "smollm2"  # the multi-token stop cases exercise the cut
    # The recording covers what it claims: text held back and released, a cut stop string.
    deltas = recorded[f"{tok_name}/text0-c1/delta"]
    assert "".join(s[0] for s in deltas) == recorded[f"{tok_name}/text0-c1/final"][0][0]
    assert recorded[f"{tok_name}/stop-straddle-inc0-c1/final"][0][3] == "ld. Th"
    assert any(s[0] == "" for s in recorded[f"{tok_name}/random0/delta"]) or tok_name != "smollm2"
    assert np.all([len(s[1]) >= 1 for s in recorded[f"{tok_name}/text0-c4/delta"]])
