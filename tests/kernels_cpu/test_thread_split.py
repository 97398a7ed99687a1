"""The kernels' work split (kernels_cpu/thread_split.h): pool threads that linger between calls and
take the next call's work must give every caller its own result, with callers on several threads
at once (XLA runs independent custom calls concurrently, and several engines share a process).

Each output group of 16 weight rows is computed whole by one thread, so a product's result does
not depend on how its work was split: every concurrent result must equal, bit for bit, the same
call made alone.
"""

import threading

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu import gguf_matmul_cpu
from kernels_cpu.gguf_matmul import to_kernel_layout

Q4_1 = 3


def _chain(ws):
    """x through products big enough to be split over two threads (1536 x 576 rows of Q4_1:
    over thread_split's work threshold), with small XLA ops between them, as in a decode step."""

    def f(x):
        outs = []
        for w in ws:
            y = gguf_matmul_cpu(x, w, Q4_1, n=1536, f32_min_rows=0)
            outs.append(y)
            x = jnp.tanh(y[:, :576]) + 0.5 * x
        return jnp.concatenate(outs, axis=-1)

    return jax.jit(f)


def test_concurrent_callers_each_get_their_own_result(cpu_kernels):
    rng = np.random.default_rng(0)
    q = gguf.GGMLQuantizationType.Q4_1
    ws = [jnp.asarray(to_kernel_layout(gguf.quants.quantize(
        (rng.standard_normal((1536, 576)) * 0.05).astype(np.float32), q), Q4_1)) for _ in range(4)]
    f = _chain(ws)
    xs = [jnp.asarray(rng.standard_normal((r, 576)).astype(np.float32)) for r in (1, 2, 1, 3, 1, 2)]
    alone = [np.asarray(f(x)) for x in xs]
    assert all(np.all(np.isfinite(a)) for a in alone)
    assert not np.array_equal(alone[0], alone[2])  # different inputs: a mix-up would show

    bad, errors = [], []

    def worker(i):
        try:
            for _ in range(40):
                got = np.asarray(f(xs[i]))
                if not np.array_equal(got, alone[i]):
                    bad.append((i, float(np.max(np.abs(got - alone[i])))))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not bad, f"results differed from the same call made alone (caller, max |diff|): {bad[:5]}"
