"""Host-side builder of flat ragged steps over a paged KV cache, for tests.

A trivial block allocator hands out blocks in a shuffled order (so block ids are not simply
0, 1, 2 and a wrong block table shows), one ``step`` packs the new tokens of several sequences
into one flat batch with its AttentionMetadata, optionally padded with dummy tokens and rows
the way the runner pads to buckets.

    pb = PagedBatchBuilder(num_blocks=64, block_size=4, max_pages_per_seq=16)
    ids, pos, md = pb.step({0: prompt_a, 1: prompt_b})     # prefill both
    ids, pos, md = pb.step({0: [tok_a], 1: [tok_b]})       # one decode step
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from jaxlm.attention.metadata import AttentionMetadata


class PagedBatchBuilder:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_pages_per_seq: int,
        *,
        seed: int = 0,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_pages_per_seq = max_pages_per_seq
        # Block 0 is kept back as the padding target of unused table entries.
        self._free = [int(b) for b in np.random.default_rng(seed).permutation(np.arange(1, num_blocks))]
        self.seq_lens: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}

    def _ensure_capacity(self, seq_id: int, total: int) -> list[int]:
        blocks = self.blocks.setdefault(seq_id, [])
        need = -(-total // self.block_size)
        if need > self.max_pages_per_seq:
            raise ValueError(f"sequence {seq_id} needs {need} pages > max_pages_per_seq")
        while len(blocks) < need:
            if not self._free:
                raise RuntimeError("out of KV blocks")
            blocks.append(self._free.pop())
        return blocks

    def free(self, seq_id: int) -> None:
        self._free.extend(self.blocks.pop(seq_id, []))
        self.seq_lens.pop(seq_id, None)

    def step(
        self,
        new_tokens: Mapping[int, Sequence[int]],
        *,
        pad_tokens: int = 0,
        pad_rows: int = 0,
    ) -> tuple[jnp.ndarray, jnp.ndarray, AttentionMetadata]:
        """Schedule ``new_tokens[seq_id]`` for each sequence (in the mapping's order).

        Returns (input_ids [T], positions [T], metadata) with T = sum of new tokens + pad_tokens.
        Rows follow the mapping's order; the padded rows come last.
        """
        ids, positions, slots, tok_req = [], [], [], []
        tables, seq_lens, ctx_lens, qsl = [], [], [], [0]
        for row, (seq_id, toks) in enumerate(new_tokens.items()):
            toks = list(toks)
            ctx = self.seq_lens.get(seq_id, 0)
            total = ctx + len(toks)
            blocks = self._ensure_capacity(seq_id, total)
            for i, t in enumerate(toks):
                p = ctx + i
                ids.append(int(t))
                positions.append(p)
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                tok_req.append(row)
            tables.append(blocks + [0] * (self.max_pages_per_seq - len(blocks)))
            seq_lens.append(total)
            ctx_lens.append(ctx)
            qsl.append(qsl[-1] + len(toks))
            self.seq_lens[seq_id] = total
        n_rows = len(new_tokens) + pad_rows
        for _ in range(pad_tokens):
            ids.append(0)
            positions.append(0)
            slots.append(-1)
            tok_req.append(n_rows - 1)
        for _ in range(pad_rows):
            tables.append([0] * self.max_pages_per_seq)
            seq_lens.append(0)
            ctx_lens.append(0)
            qsl.append(qsl[-1])

        def i32(x):
            return jnp.asarray(np.asarray(x, dtype=np.int32))

        md = AttentionMetadata(
            positions=i32(positions),
            slot_mapping=i32(slots),
            token_to_req=i32(tok_req),
            block_tables=i32(tables).reshape(n_rows, self.max_pages_per_seq),
            seq_lens=i32(seq_lens),
            context_lens=i32(ctx_lens),
            query_start_loc=i32(qsl),
        )
        return i32(ids), i32(positions), md

    @staticmethod
    def last_token_indices(new_tokens: Mapping[int, Sequence[int]]) -> np.ndarray:
        """Flat index of each sequence's last new token (where its next token is sampled)."""
        ends = np.cumsum([len(t) for t in new_tokens.values()])
        return (ends - 1).astype(np.int32)


def make_kv_caches(
    kv_cache_spec, num_blocks: int, block_size: int, dtype=jnp.float32
) -> list[jnp.ndarray]:
    """One zeroed cache per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    num_layers, kv_heads, head_dim = kv_cache_spec.num_layers, kv_cache_spec.num_kv_heads, kv_cache_spec.head_dim
    return [jnp.zeros((2, num_blocks, block_size, kv_heads, head_dim), dtype) for _ in range(num_layers)]
