"""CacheConfig: the paged KV cache."""

from __future__ import annotations

import dataclasses

from jaxlm.config.utils import arg, parse_bytes


@dataclasses.dataclass
class CacheConfig:
    """The paged KV cache."""

    block_size: int = arg(16, "tokens per KV-cache block (a power of two)")
    gpu_memory_utilization: float = arg(0.9, "fraction of device memory for weights + KV cache")
    kv_cache_memory_bytes: int | None = arg(
        None, "bytes of KV cache, e.g. 4000000000, 1e9, 4GiB, 4G (overrides --gpu-memory-utilization)",
        parse=parse_bytes, flags=("--kv-cache-memory",))
    num_gpu_blocks_override: int | None = arg(None, "number of KV-cache blocks (overrides the memory sizing)")
    enable_prefix_caching: bool = arg(True, "reuse KV blocks of shared prompt prefixes")
    # Filled by the engine once the cache is sized.
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
