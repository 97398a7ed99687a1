"""Peak host memory while loading a model onto a TP mesh of CPU devices, in a fresh process
(run by tests/model_loader/test_sharded_load_memory.py; the allocator holds nothing from earlier
work). Usage: ``python -m tests.helpers.load_peak DIR TP``; prints one JSON line.

On CPU the devices' buffers are host memory too, so a loader that streams each tensor onto its
sharding peaks near 1x the model's bytes (the shards themselves), and one that reads the whole
checkpoint first and then places it peaks near 2x. The same process measures that naive path
afterwards as the control: it shows the measurement can tell the two apart.
``python -m tests.helpers.load_peak DIR TP qwen3_moe ep``: an MoE model, expert parallel.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jaxlm.attention.backends import get_attention_backend  # noqa: E402
from jaxlm.attention.sharded import shard_attention_backend  # noqa: E402
from jaxlm.config import LoadConfig, ModelConfig  # noqa: E402
from jaxlm.executor.mesh_executor import make_mesh  # noqa: E402
from jaxlm.model_loader.loader import get_model  # noqa: E402
from jaxlm.model_loader.resolve import resolve_model_config  # noqa: E402
from jaxlm.model_loader.safetensors_utils import iterate_safetensors_file  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402


def anon_rss() -> int:
    """Anonymous resident bytes: the process's own memory, not the checkpoint's mmap'd pages."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakWatch:
    def __init__(self) -> None:
        self.base = anon_rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_rss())
            time.sleep(0.001)

    def __enter__(self) -> "PeakWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


# ~62 MiB of float32 weights each; 2 KV heads, so TP=4 replicates them on load. The MoE model's
# experts (8 x 3 x 512 x 256 a layer) are stacked on the device as they stream in.
MODELS = {
    "llama": dict(intermediate_size=1536),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=1536,
                      head_dim=64, mlp_only_layers=[]),
}


def main(work_dir: str, tp: int, family: str = "llama", expert_parallel: bool = False) -> None:
    path = tm.make_tiny_model(family, os.path.join(work_dir, "model"), hidden_size=512, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, **MODELS[family])
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    model_bytes = sum(os.path.getsize(f) for f in files)
    mc = resolve_model_config(ModelConfig(model=path), LoadConfig())
    mesh = make_mesh(tp)
    backend = shard_attention_backend(get_attention_backend("xla"), mesh)
    with PeakWatch() as streamed:
        model = get_model(mc, LoadConfig(), attn_backend=backend, mesh=mesh, enable_expert_parallel=expert_parallel)
    with PeakWatch() as naive:  # the control: the whole checkpoint on the host, then placed
        host = {name: arr for f in files for name, arr in iterate_safetensors_file(f)}
        split, whole = NamedSharding(mesh, PartitionSpec(None, "model")), NamedSharding(mesh, PartitionSpec())
        placed = {n: jax.device_put(a, split if a.ndim == 2 and a.shape[1] % tp == 0 else whole)
                  for n, a in host.items()}
        jax.block_until_ready(placed)
    print(json.dumps(dict(model_bytes=model_bytes, streamed=streamed.delta, naive=naive.delta,
                          leaves=len(jax.tree.leaves(model)))))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4], *(a == "ep" for a in sys.argv[4:5]))
