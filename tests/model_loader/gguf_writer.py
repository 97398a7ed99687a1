"""Write an HF checkpoint as a llama.cpp-style GGUF (test fixture), the way convert_hf_to_gguf does."""

from __future__ import annotations

import os
import re
from typing import Callable

import gguf
import numpy as np

from loader_helpers import hf_tensors
from tests.helpers.kquants import quantize

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # Phi-3's fused tensors
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
# Mixture of experts: the router, the shared expert, q/k norms; experts are stacked per layer.
_LAYER.update({
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
})
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    if hf.startswith("blk."):
        return hf  # already stacked experts
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: HF rotate-half q/k rows → interleaved (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, out: str, cfg,
               quant: gguf.GGMLQuantizationType | Callable[[str], gguf.GGMLQuantizationType] = gguf.GGMLQuantizationType.Q8_0,
               arch: str = "llama") -> dict[str, np.ndarray]:
    """Write ``out``; returns the dequantized reference per HF name (in HF layout, unpermuted).
    ``quant``: the type of every 2-D tensor, or a function from its HF name to its type (a
    K-quant mix as llama.cpp's Q4_K_M writes one)."""
    type_of = quant if callable(quant) else lambda _: quant
    w = gguf.GGUFWriter(out, arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == "phi3":  # as llama.cpp's Phi-3 converter writes it
        w.add_sliding_window(cfg.sliding_window or 0)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(cfg.original_max_position_embeddings))))
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    tensors = hf_tensors(hf_dir)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        tensors = _stack_experts(tensors, experts)
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if hasattr(cfg, "moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        if getattr(cfg, "head_dim", None):
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
    ref: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        arr = arr.astype(np.float32)
        if name.endswith("shared_expert_gate.weight"):
            arr = arr.reshape(-1)  # llama.cpp keeps it as a vector
        perm = arch == "llama" and (".q_proj." in name or ".k_proj." in name)
        heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
        stored = permute(arr, heads) if perm else arr
        qtype = type_of(name)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        # Rows that are not whole blocks stay F32, as llama.cpp's converter falls back.
        if arr.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32 and stored.shape[-1] % block == 0:
            q = quantize(stored, qtype)
            w.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=qtype)
            deq = gguf.quants.dequantize(q, qtype).reshape(stored.shape).astype(np.float32)
        else:  # 1-D tensors (norms, biases) stay F32 as llama.cpp keeps them
            w.add_tensor(gguf_name(name), stored)
            deq = stored
        if perm:  # the reference in HF layout: undo the permutation exactly as HF would
            deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, *deq.shape[1:]).swapaxes(1, 2).reshape(deq.shape)
        ref[name] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert os.path.getsize(out) > 0
    return ref


def _stack_experts(tensors: dict[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """HF's per-expert tensors -> llama.cpp's ``blk.N.ffn_{gate,up,down}_exps.weight`` [E, out, in]."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, list] = {}
    for name, arr in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = arr
            continue
        key = f"blk.{m.group(1)}.ffn_{_PART[m.group(3)]}_exps.weight"
        stacks.setdefault(key, [None] * num_experts)[int(m.group(2))] = arr
    out.update({k: np.stack(v) for k, v in stacks.items()})
    return out
