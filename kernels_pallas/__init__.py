"""Pallas kernels (GPU via the Triton lowering) with their pure-JAX references.

Standalone: nothing here imports jaxlm.
  * paged_decode.paged_decode_attention - one query token per row, split-K (flash-decoding)
  * ragged_paged.ragged_paged_attention - ragged prefill / mixed batches (cu_q_lens)
  * reference - dense pure-JAX oracles with the same arguments
Both kernels read K/V in place from the cache ``[2, num_blocks, block_size, Hkv, D]``
through the block table; the step's new K/V are written beforehand by a scatter.
"""

from kernels_pallas.paged_decode import paged_decode_attention
from kernels_pallas.ragged_paged import ragged_paged_attention

__all__ = ["paged_decode_attention", "ragged_paged_attention"]
