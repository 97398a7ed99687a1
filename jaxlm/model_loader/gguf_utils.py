"""GGUF (llama.cpp) checkpoints: metadata → HF config, tensor names → HF names, dequantization."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxlm.model_loader.gguf_reader import GGUFFile, GGUFTensorInfo
from jaxlm.model_loader.errors import (
    CorruptCheckpointError,
    UnexpectedWeightError,
    UnsupportedDtypeError,
    UnsupportedModelError,
)

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2")

# GGUF per-layer tensor stem → HF module path under model.layers.N.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp stores that HF derives from the config (llama3 rope frequencies).
_SKIPPED = ("rope_freqs.weight",)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def open_gguf(path: str) -> GGUFFile:
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a llama/qwen2 GGUF tensor name; None for tensors HF does not keep."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return ""  # unknown: the caller reports it


def gguf_config_dict(reader: GGUFFile, path: str) -> dict[str, Any]:
    """HF config kwargs from GGUF metadata (llama and qwen2), without going through torch."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise UnsupportedModelError(
            path, f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})"
        )

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    def need(key: str) -> int:
        value = get(key)
        if value is None:
            raise CorruptCheckpointError(path, f"GGUF metadata lacks {arch}.{key}")
        return int(value)

    hidden = need("embedding_length")
    heads = need("attention.head_count")
    vocab = get("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CorruptCheckpointError(path, f"GGUF metadata has neither {arch}.vocab_size nor a token list")
        vocab = len(tokens)
    tensor_names = {t.name for t in reader.tensors}
    cfg: dict[str, Any] = dict(
        model_type=arch,
        architectures=["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_hidden_layers=need("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        vocab_size=int(vocab),
        # No separate output matrix in the file: the LM head is the embedding.
        tie_word_embeddings="output.weight" not in tensor_names,
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        logger.warning("%s: rope scaling %r in GGUF metadata is ignored", path, scaling)
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style GGUFs carry the scaled rope frequencies as a tensor, not as metadata.
        logger.warning("%s: rope_freqs tensor ignored; llama3 rope scaling is not reconstructed from GGUF", path)
    cfg["rope_parameters"] = rope
    head_dim = get("attention.key_length")
    if head_dim is not None:
        cfg["head_dim"] = int(head_dim)
    elif arch == "llama":
        cfg["head_dim"] = hidden // heads
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        v = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if v is not None:
            cfg[hf_key] = int(v)
    return cfg


def gguf_hf_config(reader: GGUFFile, path: str) -> Any:
    from transformers import AutoConfig

    cfg = gguf_config_dict(reader, path)
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's HF→GGUF q/k row permutation (rotate-half → interleaved rope pairs).

    The converter maps each head's rows [pairs, 2] → [2, pairs] order; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_array(f: GGUFFile, t: GGUFTensorInfo) -> np.ndarray:
    """One GGUF tensor as a float numpy array in HF (numpy) shape order."""
    import gguf
    import ml_dtypes

    Q = gguf.GGMLQuantizationType
    try:
        qtype = Q(t.qtype)
    except ValueError as e:
        raise UnsupportedDtypeError(f.path, t.name, f"GGUF type id {t.qtype}") from e
    raw = f.raw(t)
    plain = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: ml_dtypes.bfloat16, Q.F64: np.float64}
    if qtype in plain:
        return raw.view(plain[qtype]).reshape(t.shape)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if not t.shape or t.shape[-1] % block:
        raise CorruptCheckpointError(f.path, f"tensor {t.name!r}: row of {t.shape[-1:]} is not whole {qtype.name} blocks")
    try:
        arr = gguf.quants.dequantize(raw.reshape(-1, t.shape[-1] // block * type_size), qtype)
    except NotImplementedError as e:
        raise UnsupportedDtypeError(f.path, t.name, f"GGUF {qtype.name}") from e
    return arr.reshape(t.shape)


def iterate_gguf_weights(reader: GGUFFile, path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float array) per tensor, dequantized one at a time so host memory stays ~one tensor."""
    arch = _field(reader, "general.architecture")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    for t in reader.tensors:
        hf_name = gguf_hf_name(t.name)
        if hf_name is None:
            continue
        if hf_name == "":
            raise UnexpectedWeightError(path, t.name)
        arr = _tensor_array(reader, t)
        # Only llama's converter permutes q/k (qwen2 keeps HF's rotate-half layout).
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_qk(arr, heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_qk(arr, kv_heads)
        yield hf_name, arr
