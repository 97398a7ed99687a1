"""GGUF (llama.cpp) checkpoints: metadata → HF config, tensor names → HF names, dequantization."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxlm.model_loader.gguf_moe import (
    fix_shape, is_moe, is_stacked_experts, moe_config, moe_hf_name, split_experts, stacked_experts_key)
from jaxlm.model_loader.gguf_reader import GGUFFile, GGUFTensorInfo
from jaxlm.model_loader.errors import (
    CorruptCheckpointError,
    UnexpectedWeightError,
    UnsupportedDtypeError,
    UnsupportedModelError,
)

logger = logging.getLogger(__name__)

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
# Tensors llama.cpp stores that HF derives from the config (llama3 rope frequencies; Phi-3's
# longrope factors, read into the config instead).
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_SKIPPED = ("rope_freqs.weight", *_ROPE_FACTORS)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def open_gguf(path: str) -> GGUFFile:
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_hf_name(gguf_name: str, layer_names: dict[str, str] | None = None, arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name (``layer_names``: an architecture's per-layer
    stems where they differ from llama's; MoE tensors by ``arch``); None for tensors HF does not
    keep."""
    moe = moe_hf_name(arch, gguf_name)
    if moe is not None:
        return moe
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    names = {**_LAYER_NAMES, **(layer_names or {})}
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return ""  # unknown: the caller reports it


_REQUIRED = object()

# HF config key <- (GGUF metadata key under "{arch}.", type, default): the keys llama and qwen2 share.
_CONFIG_KEYS: dict[str, tuple[str, type, Any]] = {
    "hidden_size": ("embedding_length", int, _REQUIRED),
    "intermediate_size": ("feed_forward_length", int, _REQUIRED),
    "num_hidden_layers": ("block_count", int, _REQUIRED),
    "num_attention_heads": ("attention.head_count", int, _REQUIRED),
    "max_position_embeddings": ("context_length", int, 2048),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", float, 1e-6),
}
# HF config key <- GGUF key under "tokenizer.ggml." (only when present).
_TOKEN_ID_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    """What differs between the GGUF architectures jaxlm reads."""

    hf_architecture: str
    # llama.cpp's converter permutes llama's q/k rows (qwen2 keeps HF's rotate-half layout).
    permuted_qk: bool
    # Llama's HF config carries head_dim and attention_bias; Qwen2's derives / fixes them.
    explicit_head_dim: bool
    attention_bias_from_tensors: bool
    # Per-layer GGUF stems that map elsewhere than llama's (Phi-3's fused tensors).
    layer_names: dict[str, str] = dataclasses.field(default_factory=dict)


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", permuted_qk=True, explicit_head_dim=True, attention_bias_from_tensors=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", permuted_qk=False, explicit_head_dim=False,
                      attention_bias_from_tensors=False),
    # Mixture of experts (jaxlm.model_loader.gguf_moe); Mixtral is "llama" with experts.
    "qwen2moe": GGUFArch("Qwen2MoeForCausalLM", permuted_qk=False, explicit_head_dim=False,
                         attention_bias_from_tensors=False),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", permuted_qk=False, explicit_head_dim=True,
                         attention_bias_from_tensors=True),
    # Phi-3 / Phi-4-mini: q/k/v and gate/up stay fused as in the HF checkpoint (the model splits them).
    "phi3": GGUFArch("Phi3ForCausalLM", permuted_qk=False, explicit_head_dim=False, attention_bias_from_tensors=False,
                     layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
}
# Architectures llama.cpp writes whose files lack what the model needs: why, per architecture.
_UNREADABLE = {
    "gemma3": "Gemma 3 GGUF files carry neither query_pre_attn_scalar, rope_local_base_freq nor the "
              "local/global layer pattern (llama.cpp fills them with constants per model size); "
              "load the safetensors checkpoint instead",
}


def _gguf_arch(reader: GGUFFile, path: str) -> tuple[str, GGUFArch]:
    arch = _field(reader, "general.architecture")
    if arch in _UNREADABLE:
        raise UnsupportedModelError(path, f"GGUF architecture {arch!r}: {_UNREADABLE[arch]}")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(
            path, f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})"
        )
    return arch, GGUF_ARCHS[arch]


def gguf_config_dict(reader: GGUFFile, path: str) -> dict[str, Any]:
    """HF config kwargs from GGUF metadata (llama and qwen2), without going through torch."""
    arch, spec = _gguf_arch(reader, path)

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    cfg: dict[str, Any] = {"model_type": arch, "architectures": [spec.hf_architecture]}
    for hf_key, (gguf_key, kind, default) in _CONFIG_KEYS.items():
        value = get(gguf_key, default)
        if value is _REQUIRED or value is None:
            raise CorruptCheckpointError(path, f"GGUF metadata lacks {arch}.{gguf_key}")
        cfg[hf_key] = kind(value)
    heads = cfg["num_attention_heads"]
    cfg["num_key_value_heads"] = int(get("attention.head_count_kv", heads))
    vocab = get("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CorruptCheckpointError(path, f"GGUF metadata has neither {arch}.vocab_size nor a token list")
        vocab = len(tokens)
    cfg["vocab_size"] = int(vocab)
    tensor_names = {t.name for t in reader.tensors}
    # No separate output matrix in the file: the LM head is the embedding.
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg["rope_parameters"] = _rope_parameters(get, tensor_names, path)
    head_dim = get("attention.key_length")
    if head_dim is not None:
        cfg["head_dim"] = int(head_dim)
    elif spec.explicit_head_dim:
        cfg["head_dim"] = cfg["hidden_size"] // heads
    if spec.attention_bias_from_tensors:
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    for hf_key, gguf_key in _TOKEN_ID_KEYS.items():
        v = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if v is not None:
            cfg[hf_key] = int(v)
    if arch == "phi3":
        _phi3_config(reader, get, cfg, path)
    if is_moe(arch, get):
        cfg.update(moe_config(arch, get, tensor_names, cfg["num_hidden_layers"]))
    cfg["quantization_config"] = {"quant_method": "gguf", "tensor_types": _tensor_types(reader, spec, arch)}
    return cfg


def _tensor_types(reader: GGUFFile, spec: GGUFArch, arch: str) -> dict[str, int]:
    """HF name -> GGML type id of each tensor kept under its own name, and of each layer's stacked
    experts under ``stacked_experts_key`` (models/quantization/gguf.py keeps the block types it has
    kernels for in their blocks)."""
    types = {}
    for t in reader.tensors:
        name = stacked_experts_key(t.name) if is_stacked_experts(t.name) else gguf_hf_name(t.name, spec.layer_names, arch)
        if name:
            types[name] = int(t.qtype)
    return types


def _phi3_config(reader: GGUFFile, get: Callable[..., Any], cfg: dict[str, Any], path: str) -> None:
    """Phi-3's rope: the rotary share of each head, and longrope's factors, which llama.cpp
    stores as two F32 tensors beside the weights."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg["rope_parameters"]
    rope["partial_rotary_factor"] = int(get("rope.dimension_count", head_dim)) / head_dim
    window = get("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window else None  # llama.cpp writes 0 for none
    orig = int(get("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
    cfg["original_max_position_embeddings"] = orig
    factors = {t.name: t for t in reader.tensors if t.name in _ROPE_FACTORS}
    if not factors:
        return
    if len(factors) != 2:
        raise CorruptCheckpointError(path, f"GGUF holds {sorted(factors)} but longrope needs both of {_ROPE_FACTORS}")
    long_f, short_f = (_tensor_array(reader, factors[n]).astype(np.float64).ravel().tolist() for n in _ROPE_FACTORS)
    rope.update(rope_type="longrope", long_factor=long_f, short_factor=short_f,
                original_max_position_embeddings=orig)
    attn_factor = get("rope.scaling.attn_factor")
    if attn_factor is not None:
        rope["attention_factor"] = float(attn_factor)


def _rope_parameters(get: Callable[..., Any], tensor_names: set[str], path: str) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        logger.warning("%s: rope scaling %r in GGUF metadata is ignored", path, scaling)
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style GGUFs carry the scaled rope frequencies as a tensor, not as metadata.
        logger.warning("%s: rope_freqs tensor ignored; llama3 rope scaling is not reconstructed from GGUF", path)
    return rope


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


def _blocks(f: GGUFFile, t: GGUFTensorInfo) -> np.ndarray:
    """A 2-D tensor's bytes as rows of blocks [rows, row bytes] (a view of the file)."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.qtype)][0]
    if len(t.shape) != 2 or t.shape[-1] % block:
        raise CorruptCheckpointError(f.path, f"tensor {t.name!r} of shape {t.shape}: rows are not whole "
                                     f"{_type_name(t.qtype)} blocks of {block} values")
    return f.raw(t).reshape(t.shape[0], -1)


def _stacked_blocks(f: GGUFFile, t: GGUFTensorInfo) -> np.ndarray:
    """A stacked experts tensor's bytes [E, rows, row bytes] (a view of the file)."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.qtype)][0]
    if len(t.shape) != 3 or t.shape[-1] % block:
        raise CorruptCheckpointError(f.path, f"tensor {t.name!r} of shape {t.shape}: not [experts, rows, whole "
                                     f"{_type_name(t.qtype)} blocks of {block} values]")
    return f.raw(t).reshape(t.shape[0], t.shape[1], -1)


# Types stored as plain numbers: nothing to say when they become the model's float dtype.
_PLAIN_TYPES = {0, 1, 30}  # F32, F16, BF16


def iterate_gguf_weights(reader: GGUFFile, path: str, blocks: frozenset[str] = frozenset()
                         ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float array) per tensor, dequantized one at a time so host memory stays ~one tensor.
    ``blocks``: HF names yielded as their GGUF blocks instead ([rows, row bytes] uint8, q/k rows
    unpermuted), for a model that keeps them (models/quantization/gguf.py)."""
    arch, spec = _gguf_arch(reader, path)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    for t in reader.tensors:
        if is_stacked_experts(t.name):
            # One stacked tensor on the host at a time, handed on expert by expert (as blocks:
            # views of the file).
            stacked = (_stacked_blocks(reader, t) if stacked_experts_key(t.name) in blocks
                       else _tensor_array(reader, t))
            yield from split_experts(arch, t.name, stacked)
            continue
        hf_name = gguf_hf_name(t.name, spec.layer_names, arch)
        if hf_name is None:
            continue
        if hf_name == "":
            raise UnexpectedWeightError(path, t.name)
        arr = _blocks(reader, t) if hf_name in blocks else fix_shape(hf_name, _tensor_array(reader, t))
        if spec.permuted_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_qk(arr, heads)
        elif spec.permuted_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_qk(arr, kv_heads)
        yield hf_name, arr


def log_dequantized_types(reader: GGUFFile, path: str, blocks: frozenset[str]) -> None:
    """One log line naming the quantized types a model that keeps ``blocks`` in GGUF blocks
    dequantizes at load instead (no kernel for them here, or no layer that takes blocks)."""
    arch, spec = _gguf_arch(reader, path)
    dequantized: dict[str, list[str]] = {}
    for t in reader.tensors:
        name = stacked_experts_key(t.name) if is_stacked_experts(t.name) else gguf_hf_name(t.name, spec.layer_names, arch)
        if t.qtype not in _PLAIN_TYPES and name not in blocks:
            dequantized.setdefault(_type_name(t.qtype), []).append(t.name)
    if dequantized:
        logger.info("%s: GGUF types without a kernel here, dequantized to float at load: %s", path,
                    "; ".join(f"{k} ({len(v)} tensors: {', '.join(v[:3])}{', ...' if len(v) > 3 else ''})"
                              for k, v in sorted(dequantized.items())))


def _type_name(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"
