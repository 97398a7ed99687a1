"""The sampler metadata's processor fields (penalties, logit bias and bans, allowed ids), filled
from the requests' host state (SamplingInputBuilder's per-request _ReqState)."""

from __future__ import annotations

from typing import Any

import numpy as np


def fill_processor_fields(f: dict[str, np.ndarray], states: list[Any], r: int, v: int, penalty_width: int,
                          max_bias_tokens: int, max_allowed_tokens: int) -> None:
    """f gets the processor fields of r rows, row i from states[i] (neutral past them and for
    states without processors); v: the vocabulary size (the padding id)."""
    f["presence_penalty"] = np.zeros(r, np.float32)
    f["frequency_penalty"] = np.zeros(r, np.float32)
    f["repetition_penalty"] = np.ones(r, np.float32)
    f["pen_ids"] = np.full((r, penalty_width), v, np.int32)
    f["pen_counts"] = np.zeros((r, penalty_width), np.int32)
    f["bias_ids"] = np.full((r, max_bias_tokens), v, np.int32)
    f["bias_vals"] = np.zeros((r, max_bias_tokens), np.float32)
    f["allowed_ids"] = np.full((r, max_allowed_tokens), v, np.int32)
    f["has_allowed"] = np.zeros(r, np.bool_)
    for i, st in enumerate(states):
        if not st.processors:
            continue
        if st.has_penalties:
            f["presence_penalty"][i], f["frequency_penalty"][i], f["repetition_penalty"][i] = st.penalties
            k = st.num_pen
            f["pen_ids"][i, :k] = st.pen_ids[:k]
            f["pen_counts"][i, :k] = st.pen_counts[:k]
        # Admission caps the entries at the row width; cut here rather than fail the step.
        kb = max_bias_tokens
        nb = min(st.bias_ids.size, kb)
        f["bias_ids"][i, :nb] = st.bias_ids[:nb]
        f["bias_vals"][i, :nb] = st.bias_vals[:nb]
        bans = banned_tokens(st)[: kb - nb]
        if bans:
            f["bias_ids"][i, nb:nb + len(bans)] = bans
            f["bias_vals"][i, nb:nb + len(bans)] = -np.inf
        if st.allowed is not None:
            f["allowed_ids"][i, :st.allowed.size] = st.allowed
            f["has_allowed"][i] = True


def banned_tokens(st: Any) -> list[int]:
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
