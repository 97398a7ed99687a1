"""KV cache blocks and the block hashes used for prefix caching."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a model's paged KV cache: one [2, blocks, block_size, kv_heads, head_dim] array per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        """K and V of one block over every layer."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


# Parent "hash" of a sequence's first block: any fixed value works, it only has to be shared.
_ROOT_HASH = 0x6A61786C6D  # "jaxlm"


class BlockHash(NamedTuple):
    """Hash of one full block, chained through its parent.

    The token ids are kept next to the hash value so that a dict lookup compares the tokens too:
    a 64-bit collision between two different blocks can never alias their K/V.
    """

    hash_value: int
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra: tuple[int, ...] = ()) -> BlockHash:
    """hash(parent_hash, tuple(tokens)): the same tokens under a different prefix hash differently.
    ``extra``: the content hashes of the images whose placeholders the block holds, kept with the
    tokens (so a lookup compares them too)."""
    tokens = tuple(token_ids) + extra
    parent_value = _ROOT_HASH if parent is None else parent.hash_value
    # Python's hash of ints/tuples of ints is deterministic across processes (no PYTHONHASHSEED).
    return BlockHash(hash((parent_value, tokens)), tokens)


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, block_hashes: list[BlockHash], num_blocks: int,
    extra_key: int = 0, block_extra: Callable[[int], tuple[int, ...]] | None = None,
) -> list[BlockHash]:
    """Extend ``block_hashes`` (in place) to cover the first ``num_blocks`` full blocks.

    ``extra_key`` (a LoRA adapter's id; 0 = none) roots the chain elsewhere: the same tokens
    under two adapters have different K/V, so their blocks never share a hash. ``block_extra(i)``:
    what block i's hash mixes in besides its tokens (multimodal/inputs.py block_extra_keys)."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    root = BlockHash(hash((_ROOT_HASH, extra_key)), ()) if extra_key else None
    parent = block_hashes[-1] if block_hashes else root
    for i in range(len(block_hashes), num_blocks):
        extra = block_extra(i) if block_extra is not None else ()
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        block_hashes.append(parent)
    return block_hashes


@dataclasses.dataclass(eq=False)
class KVCacheBlock:
    """One page of the KV cache. Identity (not value) equality: blocks are unique objects."""

    block_id: int
    # Requests holding the block; 0 = on the free list (possibly still cached).
    ref_cnt: int = 0
    # Set once the block is full, computed and registered in the prefix cache.
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hash_value:#x}"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
