"""A tiny random LLaVA (CLIP vision tower + Llama decoder) with its processor, built in-process:
the BPE test tokenizer plus an ``<image>`` token, and a CLIPImageProcessor sized to the tower."""

from __future__ import annotations

import os

import numpy as np

from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

IMAGE_SIZE, PATCH_SIZE = 16, 4  # 16 patches: 16 placeholder tokens per image ("default" drops CLS)
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2


def make_tiny_llava(path: str | os.PathLike, *, seed: int = 0) -> str:
    import torch
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    path = str(path)
    add_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tok.convert_tokens_to_ids("<image>")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = LlavaConfig(
        text_config=LlamaConfig(**small, num_key_value_heads=1, vocab_size=len(tok), bos_token_id=1, eos_token_id=2),
        # 3 vision layers, features from the second-last: a layer past the chosen one exists and is skipped.
        vision_config=CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                                       image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=24),
        image_token_index=image_token, image_seq_length=TOKENS_PER_IMAGE, vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # random weights of a visible scale, so images move the logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(path)
    return path


def random_image(seed: int, size: tuple[int, int] = (20, 24)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype(np.uint8))
