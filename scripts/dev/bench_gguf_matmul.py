"""The C++ GGUF block matmul (kernels_cpu/gguf_matmul.cc) against XLA's float32 dot, alone.

SmolLM2-135M's matrix shapes (N x K: q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536,
the tied LM head 49152x576) for M rows of activations; each figure is the median of interleaved
rounds, us per call, with what it streams (GB/s of weight bytes). A K-quant's rows are whole
super-blocks of 256 values, which 576 is not (llama.cpp's quantizer gives those tensors another
type): for them K is rounded up to 768 (marked *), against XLA's dot on the same shape. The
K-quants' blocks are random bytes with finite scales (the kernel's time does not depend on the
values). Run: python scripts/dev/bench_gguf_matmul.py [--rows 1 16 512] [--types Q4_1 Q4_K]
[--rounds 7] [--baseline DIR]; --baseline times another checkout's kernel (DIR/kernels_cpu, e.g.
`git archive main | tar -x -C DIR`) in the same rounds, built by its own build.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
_F16_AT = {12: (0, 2), 13: (0, 2), 14: (208,)}  # a K-quant super-block's f16 scales


def _blocks(rng: np.random.Generator, wf: np.ndarray, qtype: int) -> np.ndarray:
    """W [N, K] in blocks of ``qtype`` as a file has them: the gguf package's quantizer, or random
    K-quant bytes."""
    import gguf

    if qtype not in _F16_AT:
        return gguf.quants.quantize(wf, gguf.GGMLQuantizationType(qtype))
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    w = rng.integers(0, 256, (wf.shape[0], wf.shape[1] // block, size), dtype=np.uint8)
    for at in _F16_AT[qtype]:
        w[..., at:at + 2] = rng.uniform(1e-3, 0.1, w.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return w.reshape(wf.shape[0], -1)


def _time(fn, args, reps: int) -> float:
    fn(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / reps * 1e6


def _baseline_matmul(src: str, build_dir: str):
    """gguf_matmul from the checkout at ``src`` (its kernels_cpu, built by its own build.py into
    build_dir), registered under a second XLA target so both kernels run in one process, and
    its own to_kernel_layout (None for a checkout from before it, whose kernel takes the file's
    blocks): a checkout's layout may differ from this one's."""
    import ctypes
    import importlib.util

    import jax
    import jax.numpy as jnp

    from kernels_cpu.gguf_matmul import F32_MIN_ROWS

    spec = importlib.util.spec_from_file_location("baseline_build", os.path.join(src, "kernels_cpu", "build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    cxx = build._compiler()
    path = build._library_path(build_dir, cxx)
    if not os.path.exists(path):
        build._build(path, cxx)
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target("jaxlm_gguf_matmul_baseline", jax.ffi.pycapsule(lib.JaxlmGgufMatmul), platform="cpu")

    def matmul(x, w, qtype, n):
        out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
        call = jax.ffi.ffi_call("jaxlm_gguf_matmul_baseline", out)
        return call(x, w, qtype=np.int32(qtype), f32_min_rows=np.int32(F32_MIN_ROWS))

    spec = importlib.util.spec_from_file_location("baseline_gguf_matmul",
                                                  os.path.join(src, "kernels_cpu", "gguf_matmul.py"))
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    return jax.jit(matmul, static_argnums=(2, 3)), getattr(layout, "to_kernel_layout", None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    p.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"], choices=sorted(TYPE_IDS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", metavar="DIR", help="another checkout whose kernel to time beside this one")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from kernels_cpu import gguf_matmul_cpu, load_cpu_kernels
    from kernels_cpu.gguf_matmul import to_kernel_layout

    build_dir = os.path.join(os.environ.get("JAXLM_CACHE_DIR") or "/tmp", "kernels")
    load_cpu_kernels(build_dir)
    base, base_layout = _baseline_matmul(args.baseline, build_dir) if args.baseline else (None, None)
    rng = np.random.default_rng(0)
    f32 = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    quant = jax.jit(gguf_matmul_cpu, static_argnums=2)
    extra = f" {'base us':>9} {'vs base':>7}" if base else ""
    print(f"{'N x K':>12} {'M':>4} {'type':>5} {'f32 us':>9} {'gguf us':>9} {'speedup':>7} {'GB/s':>6}{extra}")
    for n, k0 in SHAPES:
        # K per type: 576 becomes 768 for the K-quants (whole super-blocks)
        by_k: dict[int, list[str]] = {}
        for t in args.types:
            by_k.setdefault(-(-k0 // 256) * 256 if TYPE_IDS[t] in _F16_AT else k0, []).append(t)
        for k, types in sorted(by_k.items()):
            wf = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            files = {t: _blocks(rng, wf, TYPE_IDS[t]) for t in types}
            blocks = {t: jnp.asarray(to_kernel_layout(files[t], TYPE_IDS[t])) for t in types}
            base_blocks = {t: jnp.asarray(base_layout(files[t], TYPE_IDS[t]) if base_layout else files[t])
                           for t in types}
            wj = jnp.asarray(wf)
            for m in args.rows:
                if n * m > 49152 * 64:  # the LM head runs on the sampled rows only
                    continue
                x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
                reps = max(3, int(2e8 / (n * k * max(m, 8))))
                times: dict[str, list[float]] = {"f32": [], **{t: [] for t in types}}
                times.update({"base " + t: [] for t in types})
                for _ in range(args.rounds):  # interleaved: the machine's load hits both alike
                    times["f32"].append(_time(f32, (x, wj), reps))
                    for t in types:
                        times[t].append(_time(quant, (x, blocks[t], TYPE_IDS[t]), reps))
                        if base:
                            times["base " + t].append(_time(base, (x, base_blocks[t], TYPE_IDS[t], n), reps))
                f32_us = statistics.median(times["f32"])
                mark = "*" if k != k0 else " "
                for t in types:
                    us = statistics.median(times[t])
                    line = (f"{n:>6}x{k:<4}{mark} {m:>4} {t:>5} {f32_us:>9.1f} {us:>9.1f} {f32_us / us:>6.2f}x "
                            f"{blocks[t].nbytes / us / 1e3:>6.1f}")
                    if base:
                        base_us = statistics.median(times["base " + t])
                        line += f" {base_us:>9.1f} {base_us / us:>6.2f}x"
                    print(line, flush=True)
    print("load:", os.getloadavg())


if __name__ == "__main__":
    main()
