"""Quantized MoE experts under expert and tensor parallel on 8 CPU devices, in a subprocess of
tests/models/quantization/test_quantized_moe_tp.py (``python -m tests.helpers.quant_moe_mesh_cases
OUT.json DIR``).

Per case: greedy tokens and top logprobs through ``LLM`` (quant_moe's prompts, chunked prefill),
the same from transformers on the dequantized weights, the shapes of device 0's shards of the
stacked expert Params; plus the error for int experts whose down projection's groups do not
split over the devices.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # its own process; a test importing its cases keeps the suite at one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

from tests.helpers import quant_checkpoints as qc  # noqa: E402
from tests.helpers import quant_moe as qm  # noqa: E402
from tests.helpers.moe_cases import error_of  # noqa: E402

# name -> (format or "online", tensor_parallel_size, enable_expert_parallel). 7 experts at EP=2:
# 4 and 3 a device, the last slot padding.
CASES = {
    "fp8-static/ep2": ("fp8-static", 2, True),
    "online/tp2": ("online", 2, False),
    "awq/tp2": ("awq", 2, False),
    # per-channel int8: a row-parallel Linear's one scale row stays whole on each device
    "ct-w8a16/tp2": ("ct-w8a16", 2, False),
}


def main(out_path: str, work_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    # A shared expert of 64 (4 groups of 16): its row-parallel down projection splits into whole
    # groups over 2 and 4 devices, as the Linears' packed layout needs.
    base = qm.float_model(work_dir, shared_expert_intermediate_size=64)
    results: dict = {}
    for name, (fmt, tp, ep) in CASES.items():
        if fmt == "online":
            path, ref = base, qc.fp8_per_channel_reference(base, os.path.join(work_dir, "online-ref"))
        else:
            path, ref = qm.quantized(base, fmt, work_dir)
        got, facts = qm.run_llm(path, quantization="fp8" if fmt == "online" else None, tensor_parallel_size=tp,
                                enable_expert_parallel=ep)
        results[name] = dict(got=got, want=qm.hf_greedy(ref), **facts)
    # Groups of 16 over experts of 32: 2 groups cannot split over 4 devices (4 KV heads: the
    # attention splits over 4 without repeating heads, which packed weights refuse first).
    heads4 = qm.float_model(work_dir, name="kv4", num_key_value_heads=4, shared_expert_intermediate_size=64)
    path, _ = qm.quantized(heads4, "ct-w4a16", work_dir)
    results["group_error"] = error_of(path, 4, False)
    # A shared expert of 48 (3 groups of 16): its row-parallel down projection (a Linear) cannot
    # split its groups over 2 devices, while the experts split by expert.
    shared48 = qm.float_model(work_dir, name="shared48", shared_expert_intermediate_size=48)
    path, _ = qm.quantized(shared48, "awq", work_dir)
    results["linear_group_error"] = error_of(path, 2, True)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
