"""CacheConfig: the paged KV cache."""

from __future__ import annotations

import dataclasses

from jaxlm.config.utils import KV_CACHE_DTYPES, arg, parse_bytes


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
    kv_cache_dtype: str = arg(
        "auto", "KV cache storage dtype: auto = the model's; fp8 = fp8_e4m3 (per-tensor K/V scales from the "
        "checkpoint, else 1.0); fp8 holds 4x float32's tokens in the same memory", choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = arg(
        False, "fp8 KV cache: compute the K/V scales from the first batch (max|K|/200, max|V|/100) instead "
        "of the checkpoint's")
    # Filled by the engine once the cache is sized.
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"Unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"calculate_kv_scales needs an fp8 kv_cache_dtype, not {self.kv_cache_dtype!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
