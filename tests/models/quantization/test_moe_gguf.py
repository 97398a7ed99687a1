"""GGUF MoE experts kept in their blocks (``GGUFMoEMethod``) through ``LLM``, against
transformers on the file's dequantized weights (tests/helpers/gguf_moe.py).

Two tiny files, one engine each:
- Qwen2-MoE (hidden 64, 7 experts of 32, a shared expert): experts gate Q8_0, up Q4_1, down
  Q4_0; Linears Q8_0. The C++ kernel rounds each product's x to int8 per block of 32 (every
  Linear's too), so transformers' float model is matched on the greedy tokens and within
  ``KERNEL_TOL`` = 0.05 nats on the top-4 logprobs of the tokens both rank there (seen 0.020;
  a random model's 4th place is often a near tie the rounding swaps).
- Qwen3-MoE (hidden 256, 9 experts of 256): layer 0 gate/up Q4_K and down Q6_K (Q4_K_M's mix),
  layer 2 gate Q8_0, up Q4_1, down Q5_K. Kernel path: the same greedy tokens, top-4 logprobs
  within ``KQUANT_TOL`` = 0.1 nats on the tokens both rank there (seen 0.036; the 4th place is a
  near tie); the accelerators' path (blocks in the file's layout, dequantized in XLA inside
  the step, forced on CPU): within ``TOL`` = 1e-4 of transformers (seen 1e-5: the same f32
  weights).
Either way the experts hold the file's bytes (no float copy), a second run of the prompts
(prefix cache hits; the 21-token prompt was prefilled in two chunks) gives the same tokens, and
nothing compiles after warm-up. A file whose expert tensors do not match its config is refused
naming the tensor.
"""

from __future__ import annotations

import os
import re

import gguf
import pytest
import transformers

from jaxlm.attention.backends import cpu_kernels_unavailable
from tests.helpers import gguf_moe as gm
from tests.helpers import quant_moe as qm
from tests.helpers import tiny_models as tm

_Q = gguf.GGMLQuantizationType
TOL, KERNEL_TOL, KQUANT_TOL = 1e-4, 0.05, 0.1
_EXPS = re.compile(r"blk\.(\d+)\.ffn_(\w+)_exps")
QWEN2 = {"gate": _Q.Q8_0, "up": _Q.Q4_1, "down": _Q.Q4_0}
QWEN3 = {("0", "gate"): _Q.Q4_K, ("0", "up"): _Q.Q4_K, ("0", "down"): _Q.Q6_K,
         ("2", "gate"): _Q.Q8_0, ("2", "up"): _Q.Q4_1, ("2", "down"): _Q.Q5_K}

pytestmark = pytest.mark.skipif(bool(cpu_kernels_unavailable()), reason="the C++ kernels cannot be built here")


def _qwen2(name: str):
    m = _EXPS.match(name)
    return QWEN2[m.group(2)] if m else _Q.Q8_0


def _qwen3(name: str):
    m = _EXPS.match(name)
    return QWEN3[m.groups()] if m else _Q.Q8_0


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gguf_moe_qwen2"))
    src = tm.make_tiny_model("qwen2_moe", os.path.join(root, "src"))
    path, ref = gm.write(src, os.path.join(root, "gguf"), _qwen2, "qwen2_moe")
    got, facts = gm.run_llm(path, src, twice=True, enable_prefix_caching=True)
    return dict(src=src, path=path, got=got, facts=facts, want=qm.hf_greedy(ref))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gguf_moe_qwen3"))
    src = tm.make_tiny_model("qwen3_moe", os.path.join(root, "src"), hidden_size=256, moe_intermediate_size=256,
                             initializer_range=0.02)
    path, ref = gm.write(src, os.path.join(root, "gguf"), _qwen3, "qwen3_moe")
    got, facts = gm.run_llm(path, src, twice=True, enable_prefix_caching=True)
    return dict(src=src, path=path, got=got, facts=facts, want=qm.hf_greedy(ref))


def _held_is_the_file(run: dict, kernel_layout: bool = True) -> None:
    experts = run["facts"]["experts"]
    assert experts and all(v["dtype"] == "uint8" for v in experts.values()), experts
    held, file = sum(v["bytes"] for v in experts.values()), sum(gm.expert_tensor_bytes(run["path"]).values())
    # The file's bytes in the kernel's layout: the same for the 32-value types and Q6_K, Q4_K's and
    # Q5_K's 6-bit scales unpacked to a byte each (+2.3-2.8%); no float copy.
    want = gm.expert_kernel_layout_bytes(run["path"]) if kernel_layout else file
    assert held == want and file <= held <= 1.03 * file, (held, want, file)


def test_qwen2_moe_experts_in_blocks_match_transformers(qwen2):
    assert [g["tokens"] for g in qwen2["got"]] == [w["tokens"] for w in qwen2["want"]]
    assert qm.max_logprob_diff(qwen2["got"], qwen2["want"], common_only=True) < KERNEL_TOL
    _held_is_the_file(qwen2)
    facts = qwen2["facts"]
    assert [g["tokens"] for g in facts["again"]] == [g["tokens"] for g in qwen2["got"]]
    assert facts["compiles"] == 0
    # The shared expert is plain Linears: in blocks through GGUFLinearMethod (its down
    # projection's 48 inputs are no whole blocks of 32: the file keeps it F32).
    dtypes = facts["dtypes"]
    assert dtypes["model.layers.1.mlp.shared_expert.gate_proj.qweight"] == "uint8"
    assert dtypes["model.layers.1.mlp.shared_expert.up_proj.qweight"] == "uint8"
    assert dtypes["model.layers.1.mlp.shared_expert.down_proj.weight"] == "float32"


def test_qwen3_moe_k_quant_experts_match_transformers(qwen3):
    assert [g["tokens"] for g in qwen3["got"]] == [w["tokens"] for w in qwen3["want"]]
    assert qm.max_logprob_diff(qwen3["got"], qwen3["want"], common_only=True) < KQUANT_TOL
    _held_is_the_file(qwen3)
    facts = qwen3["facts"]
    shapes = {k.split("experts.")[0] + k.rsplit(".", 1)[-1]: v["shape"] for k, v in facts["experts"].items()}
    # 256 rows in 16 groups of 16 rows: Q6_K's 210 bytes a super-block, Q5_K's 176 with its scales
    # unpacked (180), a group's 16 rows side by side
    assert shapes["model.layers.0.mlp.down_qweight"] == [9, 16, 16 * 210]
    assert shapes["model.layers.2.mlp.down_qweight"] == [9, 16, 16 * 180]
    assert [g["tokens"] for g in facts["again"]] == [g["tokens"] for g in qwen3["got"]]
    assert facts["compiles"] == 0


def test_accelerator_path_equals_transformers(qwen3, monkeypatch):
    """The blocks in the file's layout, dequantized in XLA inside each product (what a GPU or
    TPU runs), on the same file: transformers' float model within 1e-4."""
    import jaxlm.models.quantization.gguf as gguf_config
    from kernels_cpu.gguf_matmul import GGUF_KERNEL_TYPES

    monkeypatch.setattr(gguf_config, "_block_plan_here", lambda: (frozenset(GGUF_KERNEL_TYPES), False))
    got, facts = gm.run_llm(qwen3["path"], qwen3["src"])
    assert [g["tokens"] for g in got] == [w["tokens"] for w in qwen3["want"]]
    assert qm.max_logprob_diff(got, qwen3["want"]) < TOL
    _held_is_the_file(dict(qwen3, facts=facts), kernel_layout=False)


def test_expert_tensor_that_does_not_match_the_config_is_named(tmp_path):
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import get_model, resolve_model_config
    from jaxlm.model_loader.errors import WeightLoadError

    src = tm.make_tiny_model("qwen3_moe", tmp_path / "src")
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.moe_intermediate_size = 64  # the metadata says 64, the expert tensors hold 32 rows
    path = str(tmp_path / "broken.gguf")
    gm.write_gguf(src, path, cfg, _Q.Q8_0, arch="qwen3moe")
    with pytest.raises((WeightLoadError, ValueError), match=r"model\.layers\.0\.mlp\.experts\.0\.(gate|up|down)_proj"):
        lc = LoadConfig()
        get_model(resolve_model_config(ModelConfig(model=path), lc), lc, attn_backend=None)
