"""A dense attention backend for engine-level tests: the K/V write, then every token attends to
keys [0, position] of its row gathered in full (kernels_pallas.reference): no tiles, no chunks,
no online softmax. Engines built inside ``dense_xla_backend()`` run it in place of the XLA
backend."""

from __future__ import annotations

import contextlib

from jaxlm.attention import backends
from jaxlm.attention.backends import FunctionBackend
from jaxlm.attention.xla_backend import write_kv
from kernels_pallas.reference import ragged_paged_reference


def dense_attention(q, k, v, kv_cache, md, *, scale, sliding_window=None, logits_soft_cap=None):
    kv_cache = write_kv(kv_cache, k, v, md.slot_mapping)
    out = ragged_paged_reference(q, kv_cache, md.block_tables, md.context_lens, md.query_start_loc,
                                 scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    return out, kv_cache


@contextlib.contextmanager
def dense_xla_backend():
    """Inside: get_attention_backend("xla") returns the dense backend (an engine builds its
    model's backend at construction, so one built inside keeps it)."""
    saved = backends._make_xla
    backends._make_xla = lambda: FunctionBackend("xla", dense_attention)
    try:
        yield
    finally:
        backends._make_xla = saved
