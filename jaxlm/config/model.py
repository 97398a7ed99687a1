"""ModelConfig: which model and tokenizer, in which dtype, and its request limits."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxlm.config.utils import (
    DTYPE_ALIASES, DTYPES, QUANTIZATION_METHODS, arg, human_readable_int, parse_json_object)


@dataclasses.dataclass
class ModelConfig:
    """Which model and tokenizer, in which dtype, and its request limits."""

    model: str | None = arg(None, "HF model directory, .gguf file or orbax checkpoint "
                                  "(default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = arg(None, "tokenizer directory (default: the model's)")
    skip_tokenizer_init: bool = arg(False, "load no tokenizer (the model needs no tokenizer files): prompts "
                                           "must be token ids, outputs carry token ids and empty text; stop "
                                           "strings, bad words, structured outputs and chat are refused")
    revision: str | None = arg(None, "revision (branch, tag or commit) of an org/name model in the local HF cache")
    trust_remote_code: bool = arg(False, "accepted for vLLM scripts; jaxlm never runs a model's remote code "
                                         "(its own model classes and HF fast tokenizers only)")
    dtype: str = arg("auto", "weights and activations dtype (auto: float32 on CPU, the checkpoint's on GPU; "
                             "half = float16, float = float32)", choices=DTYPES)
    quantization: str | None = arg(None, "weight quantization: fp8 quantizes a float checkpoint per output "
                                         "channel at load; awq, gptq, compressed-tensors (and fp8) are read from "
                                         "a checkpoint's quantization_config, which is used when this is left out; "
                                         "gguf keeps a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K tensors in "
                                         "their blocks with C++ kernels on CPU (the default for a .gguf model); "
                                         "none dequantizes a "
                                         "GGUF file to float at load",
                                   choices=QUANTIZATION_METHODS)
    max_model_len: int | None = arg(None, "longest prompt + output in tokens; 32k = 32000, 32K = 32768 "
                                          "(default: the model's, capped at 2048 on CPU)", parse=human_readable_int)
    seed: int = arg(0, "engine seed for requests without their own")
    served_model_name: list[str] | None = arg(None, "model name(s) the server answers to (default: --model)",
                                              nargs="+")
    generation_config: str = arg("auto", "default sampling: auto (the model's generation_config.json), "
                                         "vllm (SamplingParams' defaults) or a directory holding one")
    override_generation_config: dict[str, Any] | None = arg(
        None, "JSON object on top of the generation config, e.g. '{\"temperature\": 0.5}'", parse=parse_json_object)
    limit_mm_per_prompt: dict[str, Any] | None = arg(
        None, "JSON object: the most items of each modality one prompt may carry, e.g. '{\"image\": 2}' "
              "(default 4 images; every count up to it has a compiled encoder program)", parse=parse_json_object)
    mm_processor_kwargs: dict[str, Any] | None = arg(
        None, "JSON object: options for the model's image processor, on top of its preprocessor_config.json, "
              "e.g. '{\"max_pixels\": 401408}' (Qwen2.5-VL's largest image; also sizes its encoder buckets)",
        parse=parse_json_object)
    allowed_local_media_path: str | None = arg(
        None, "directory whose files chat image_url parts may name as file:///abs/path URLs (their real "
              "path, symlinks and .. resolved, must lie inside it); without it file: URLs are refused")
    max_logprobs: int = arg(20, "most logprobs (and prompt logprobs) a request may ask for")
    chat_template: str | None = arg(None, "chat template: a Jinja file or the template itself "
                                          "(default: the tokenizer's)")
    enforce_eager: bool = arg(False, "accepted for vLLM scripts; jaxlm runs compiled XLA programs only, "
                                     "so True is refused")
    # Filled by jaxlm.model_loader.resolve_model_config(): the transformers config.
    hf_config: Any = None
    # Filled once the model is loaded: the bytes its weights take on the devices (quantized
    # weights in their own bytes), for the start-up log and /metrics.
    weight_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"Unknown quantization {self.quantization!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.enforce_eager:
            raise ValueError("enforce_eager=True is not supported: jaxlm runs only compiled XLA programs "
                             "(--compilation-cache-dir keeps them across restarts)")
        self.chat_template = load_chat_template(self.chat_template)
        if self.allowed_local_media_path is not None:
            if not os.path.isdir(self.allowed_local_media_path):
                raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not an existing "
                                 "directory")
            self.allowed_local_media_path = os.path.realpath(self.allowed_local_media_path)


def load_chat_template(chat_template: str | None) -> str | None:
    """A chat template given as a file's path (read) or as the template itself (vLLM's rule)."""
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if chat_template is not None and not any(c in chat_template for c in "{}\n"):
        raise ValueError(f"chat_template {chat_template!r} looks like a path, but no such file exists")
    return chat_template
