"""GGUF mixture-of-experts checkpoints (llama.cpp's Mixtral under ``llama``, ``qwen2moe``,
``qwen3moe``): the MoE metadata -> HF config keys, and the expert tensors -> HF names.

llama.cpp stores each layer's experts stacked (``blk.N.ffn_{gate,up,down}_exps``, numpy shape
[E, out, in]); they are read one stacked tensor at a time and handed on as HF's per-expert
tensors (views of it), which the model writes into its own stacked Params: floats, or the
file's blocks [out, row bytes] when the model keeps that layer's experts in them
(models/quantization/gguf_moe.py). Older Mixtral files keep one tensor per expert
(``blk.N.ffn_gate.E.weight``); those are dequantized at load. The quantization types are those
the ``gguf`` package dequantizes; any other is an UnsupportedDtypeError naming the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# Stacked expert tensors and the per-expert ones of older Mixtral files.
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_OLD_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
# Per-layer MoE tensor stems -> HF module path under model.layers.N (Qwen-MoE's names).
MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Mixtral's checkpoint names for the same parts.
_MIXTRAL_EXPERT = {"gate": "w1", "down": "w2", "up": "w3"}
_QWEN_EXPERT = {"gate": "gate_proj", "down": "down_proj", "up": "up_proj"}

# GGUF architecture -> (HF architecture, model_type) once it has experts.
MOE_ARCHS = {
    "llama": ("MixtralForCausalLM", "mixtral"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# norm_topk_prob when the file does not say (expert_weights_norm): the released models' value.
_DEFAULT_NORM = {"qwen2moe": False, "qwen3moe": True}


def is_moe(arch: str, get: Callable[..., Any]) -> bool:
    return arch in MOE_ARCHS and int(get("expert_count", 0) or 0) > 0


def moe_config(arch: str, get: Callable[..., Any], tensor_names: set[str], num_layers: int) -> dict[str, Any]:
    """HF config keys of an MoE GGUF (besides the ones every architecture shares)."""
    hf_arch, model_type = MOE_ARCHS[arch]
    cfg: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type,
                           "num_experts_per_tok": int(get("expert_used_count"))}
    experts = int(get("expert_count"))
    if arch == "llama":  # Mixtral: every layer sparse, experts sized feed_forward_length
        cfg["num_local_experts"] = experts
        return cfg
    cfg["num_experts"] = experts
    cfg["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    norm = get("expert_weights_norm")
    cfg["norm_topk_prob"] = bool(_DEFAULT_NORM[arch] if norm is None else norm)
    # Dense layers are the ones without a router.
    cfg["decoder_sparse_step"] = 1
    cfg["mlp_only_layers"] = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    if arch == "qwen2moe":
        cfg["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0) or 0)
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    return cfg


def moe_hf_name(arch: str, gguf_name: str) -> str | None:
    """HF name of a single (non-stacked) MoE tensor; None when it is not one."""
    m = _OLD_EXPERT_RE.match(gguf_name)
    if m:
        return _expert_name(arch, m.group(1), m.group(3), m.group(2))
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in MOE_LAYER_NAMES:
        module = MOE_LAYER_NAMES[parts[2]]
        if arch == "llama" and module == "mlp.gate":
            module = "block_sparse_moe.gate"
        return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    return None


def _expert_name(arch: str, layer: str, expert: int | str, part: str) -> str:
    if arch == "llama":
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_MIXTRAL_EXPERT[part]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{_QWEN_EXPERT[part]}.weight"


def is_stacked_experts(gguf_name: str) -> bool:
    return _EXPS_RE.match(gguf_name) is not None


def stacked_experts_key(gguf_name: str) -> str:
    """The name one stacked ``ffn_*_exps`` tensor goes by in the quantization config's
    ``tensor_types`` and the loader's block names: the model's experts module (``mlp.experts``
    in every family, Mixtral's ``block_sparse_moe`` included) and HF's projection name, without an
    expert index (``model.layers.N.mlp.experts.gate_proj.weight``)."""
    m = _EXPS_RE.match(gguf_name)
    return f"model.layers.{m.group(1)}.mlp.experts.{_QWEN_EXPERT[m.group(2)]}.weight"


def split_experts(arch: str, gguf_name: str, arr: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, [out, in] view) per expert of one stacked ``ffn_*_exps`` tensor [E, out, in]."""
    m = _EXPS_RE.match(gguf_name)
    for e in range(arr.shape[0]):
        yield _expert_name(arch, m.group(1), e, m.group(2)), arr[e]


def fix_shape(hf_name: str, arr: np.ndarray) -> np.ndarray:
    """llama.cpp keeps the shared expert's gate [1, hidden] as a vector."""
    if hf_name.endswith("shared_expert_gate.weight") and arr.ndim == 1:
        return arr.reshape(1, -1)
    return arr
