"""One attention step over a paged cache for backend tests: several rows, each with its own
cached context and query length, plus padding rows and tokens, as the runner hands them over."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxlm.attention.metadata import AttentionMetadata


def ragged_step(rng, rows, bs, hkv, d, *, garbage, pages=None, spare_blocks=2, pad_page=None,
                pad_tokens=3, pad_rows=2):
    """rows: (context_len, query_len) each. Returns (cache, kv_new, md): a cache filled with
    `garbage` and each row's context written; the step's new K/V [2, T, hkv, d] with `garbage`
    in the padding tokens. Block-table padding points at `pad_page` (None: a garbage page)."""
    pages = pages or max(-(-(c + n) // bs) for c, n in rows) + 1
    nb = sum(-(-(c + n) // bs) for c, n in rows) + spare_blocks
    cache = np.full((2, nb, bs, hkv, d), garbage, np.float32)
    free = list(rng.permutation(nb))
    tables, pos, slots, tok_req, new_kv = [], [], [], [], []
    for r, (ctx, ql) in enumerate(rows):
        blocks = [int(free.pop()) for _ in range(-(-(ctx + ql) // bs))]
        tables.append(blocks + [free[0] if pad_page is None else pad_page] * (pages - len(blocks)))
        kv = rng.standard_normal((2, ctx + ql, hkv, d)).astype(np.float32)
        for p in range(ctx):
            cache[:, blocks[p // bs], p % bs] = kv[:, p]
        for p in range(ctx, ctx + ql):
            pos.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            tok_req.append(r)
        new_kv.append(kv[:, ctx:])
    n_rows = len(rows) + pad_rows
    pos += [0] * pad_tokens
    slots += [-1] * pad_tokens
    tok_req += [n_rows - 1] * pad_tokens
    tables += [[0] * pages] * pad_rows
    qlens = [n for _, n in rows] + [0] * pad_rows
    i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)  # noqa: E731
    md = AttentionMetadata(
        positions=i32(pos), slot_mapping=i32(slots), token_to_req=i32(tok_req),
        block_tables=i32(tables), seq_lens=i32([c + n for c, n in rows] + [0] * pad_rows),
        context_lens=i32([c for c, _ in rows] + [0] * pad_rows),
        query_start_loc=i32(np.concatenate([[0], np.cumsum(qlens)])))
    kv_new = np.concatenate(new_kv + [np.full((2, pad_tokens, hkv, d), garbage, np.float32)], axis=1)
    return cache, kv_new, md
