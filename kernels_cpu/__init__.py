"""C++ kernels for XLA:CPU, called from jitted programs through XLA's FFI.

Standalone: nothing here imports jaxlm. Built with the host's C++ compiler on first use
(``build.load_cpu_kernels``), so a machine without one keeps the pure-XLA path.
  * paged_decode.paged_decode_cpu - one query token per row, read in place from the paged cache
  * gguf_matmul.gguf_matmul_cpu - activations times weights kept in GGUF's Q8_0 / Q4_0 / Q4_1 blocks
    and Q4_K / Q5_K / Q6_K super-blocks, in the kernel's layout (weight rows interleaved 16 at a
    time: gguf_matmul.to_kernel_layout, on the host at load)
Both split their work over XLA's intra-op threads the same way (thread_split.h).
"""

from kernels_cpu.build import KernelBuildError, load_cpu_kernels
from kernels_cpu.gguf_matmul import GGUF_KERNEL_TYPES, gguf_matmul_cpu
from kernels_cpu.paged_decode import paged_decode_cpu

__all__ = ["GGUF_KERNEL_TYPES", "KernelBuildError", "gguf_matmul_cpu", "load_cpu_kernels", "paged_decode_cpu"]
