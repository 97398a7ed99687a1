"""GGUF MoE experts in blocks under expert and tensor parallel on 8 CPU devices, in a subprocess of
tests/models/quantization/test_gguf_moe_tp.py (``python -m tests.helpers.gguf_moe_mesh_cases OUT.json DIR``).

A tiny Qwen2-MoE with experts of 64 (so each of 2 devices gets 32 rows: 2 kernel row groups of
16, and 32 down inputs: one Q8_0 block); gate Q8_0, up Q4_1, down Q8_0. Per case: greedy tokens
and top logprobs, transformers' on the dequantized weights, device 0's shard shapes; plus the
refusal of experts of 32 over 2 devices (16 down inputs a device: half a block).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import gguf  # noqa: E402
import jax  # noqa: E402

from tests.helpers import gguf_moe as gm  # noqa: E402
from tests.helpers import quant_moe as qm  # noqa: E402
from tests.helpers import tiny_models as tm  # noqa: E402

_Q = gguf.GGMLQuantizationType
CASES = {"ep2": (2, True), "tp2": (2, False)}
_TYPES = {"gate": _Q.Q8_0, "up": _Q.Q4_1, "down": _Q.Q8_0}


def _types(name: str):
    m = re.match(r"blk\.\d+\.ffn_(\w+)_exps", name)
    return _TYPES[m.group(1)] if m else _Q.Q8_0


def main(out_path: str, work_dir: str) -> None:
    from jaxlm import LLM

    assert len(jax.devices()) == 8, jax.devices()
    src = tm.make_tiny_model("qwen2_moe", os.path.join(work_dir, "src"), moe_intermediate_size=64,
                             shared_expert_intermediate_size=64)
    path, ref = gm.write(src, os.path.join(work_dir, "gguf"), _types, "qwen2_moe")
    want = qm.hf_greedy(ref)
    results: dict = {}
    for name, (tp, ep) in CASES.items():
        got, facts = gm.run_llm(path, src, tensor_parallel_size=tp, enable_expert_parallel=ep)
        facts.pop("dtypes")
        results[name] = dict(got=got, want=want, **facts)
    small = tm.make_tiny_model("qwen2_moe", os.path.join(work_dir, "src32"), shared_expert_intermediate_size=64)
    path32, _ = gm.write(small, os.path.join(work_dir, "gguf32"), _types, "qwen2_moe")
    try:
        LLM(model=path32, tokenizer=small, tensor_parallel_size=2, **qm.ENGINE)
        results["split_error"] = ""
    except ValueError as e:
        results["split_error"] = str(e)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
