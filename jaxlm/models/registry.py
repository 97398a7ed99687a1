"""HF ``architectures[0]`` -> model class, imported lazily (vLLM's ``_MODELS`` / ``ModelRegistry``).

Out-of-tree models register by qualified name so nothing is imported until it is used::

    ModelRegistry.register_model("MyForCausalLM", "my_pkg.my_model:MyForCausalLM")
"""

from __future__ import annotations

import copy
import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

# architecture -> (module under jaxlm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    # Gemma 3 4B and up are published as multimodal checkpoints: served for text, on their text_config.
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    # Image inputs (multi_modal_data, chat image_url parts).
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    # Pooling models (the pooling runner: embed, classify, score).
    "BertModel": ("bert", "BertModel"),
    "XLMRobertaModel": ("bert", "XLMRobertaModel"),
    "RobertaModel": ("bert", "XLMRobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    "RobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    "LlamaModel": ("pooling_adapters", "LlamaModel"),
    "MistralModel": ("pooling_adapters", "MistralModel"),
    "Qwen2Model": ("pooling_adapters", "Qwen2Model"),
    "Qwen3Model": ("pooling_adapters", "Qwen3Model"),
    "LlamaForSequenceClassification": ("pooling_adapters", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("pooling_adapters", "MistralForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("pooling_adapters", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("pooling_adapters", "Qwen3ForSequenceClassification"),
}
# Multimodal architectures served with image inputs: their text_config, carrying the fields of the
# checkpoint's config that the vision tower and the projector read.
_MULTIMODAL = frozenset({"LlavaForConditionalGeneration", "Gemma3ForConditionalGeneration",
                         "Qwen2_5_VLForConditionalGeneration"})
_VISION_FIELDS = ("vision_config", "image_token_index", "image_seq_length", "projector_hidden_act",
                  "vision_feature_layer", "vision_feature_select_strategy", "multimodal_projector_bias",
                  "mm_tokens_per_image", "image_token_id", "video_token_id", "vision_start_token_id",
                  "vision_end_token_id")


def _import_qualified(qualname: str) -> type:
    module, sep, attr = qualname.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"model class must be given as 'package.module:ClassName', got {qualname!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class _ModelRegistry:
    def __init__(self) -> None:
        # architecture -> "pkg.module:Class" or an already imported class
        self._models: dict[str, str | type] = {
            arch: f"jaxlm.models.{mod}:{cls}" for arch, (mod, cls) in _MODELS.items()
        }

    def get_supported_archs(self) -> list[str]:
        return sorted(self._models)

    def is_supported(self, arch: str) -> bool:
        return arch in self._models

    def register_model(self, arch: str, model_cls: str | type) -> None:
        """Register (or override) ``arch`` with a class or its ``"pkg.module:Class"`` name."""
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(f"model class must be given as 'package.module:ClassName', got {model_cls!r}")
        if arch in self._models:
            logger.warning("Model architecture %s is already registered; overriding it", arch)
        self._models[arch] = model_cls

    def resolve_model_cls(self, architectures: str | list[str]) -> tuple[type, str]:
        """First supported architecture of the list -> (class, architecture)."""
        archs = [architectures] if isinstance(architectures, str) else list(architectures or [])
        for arch in archs:
            entry = self._models.get(arch)
            if entry is None:
                continue
            cls = _import_qualified(entry) if isinstance(entry, str) else entry
            return cls, arch
        raise ValueError(self.unsupported_message(archs))

    def unsupported_message(self, archs: list[str]) -> str:
        return (f"Model architectures {archs} are not supported by jaxlm. "
                f"Supported architectures: {', '.join(self.get_supported_archs())}")


ModelRegistry = _ModelRegistry()


def get_model_architecture(hf_config: Any) -> type:
    """The model class for an HF config (its ``architectures`` field)."""
    archs = getattr(hf_config, "architectures", None) or []
    cls, _ = ModelRegistry.resolve_model_cls(archs)
    return cls


def is_multimodal_config(hf_config: Any) -> bool:
    """Whether the model takes image inputs (the config as resolve_model_config leaves it)."""
    archs = getattr(hf_config, "architectures", None) or []
    return bool(_MULTIMODAL.intersection(archs)) and getattr(hf_config, "vision_config", None) is not None


def unsupported_architecture(hf_config: Any) -> str | None:
    """Why jaxlm cannot build the model of `hf_config`, None when it can. Reads only the
    config's ``architectures``: the rest of a config (its text_config, vision_config,
    qformer_config, ...) belongs to that architecture and may lack what a supported one has."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if any(ModelRegistry.is_supported(arch) for arch in archs):
        return None
    return ModelRegistry.unsupported_message(archs)


def text_model_config(hf_config: Any) -> Any:
    """The config the model runs on: for a multimodal checkpoint, its ``text_config`` under the
    checkpoint's architectures and special token ids (vocab size, heads and context length live
    there) carrying the fields the vision tower and projector read; any other config as is."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    multimodal = bool(_MULTIMODAL.intersection(archs))
    if not multimodal or getattr(hf_config, "text_config", None) is None:
        return hf_config
    text = copy.deepcopy(hf_config.get_text_config())
    text.architectures = archs
    for key in _VISION_FIELDS:
        if hasattr(hf_config, key):
            setattr(text, key, copy.deepcopy(getattr(hf_config, key)))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(hf_config, key, None)
        if value is not None:
            setattr(text, key, value)
    # transformers 5.x keeps Qwen2.5-VL's tying on the outer config only (its 3B is tied).
    if not hasattr(text, "tie_word_embeddings") and hasattr(hf_config, "tie_word_embeddings"):
        text.tie_word_embeddings = bool(hf_config.tie_word_embeddings)
    return text
