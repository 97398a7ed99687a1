"""A tiny random Qwen2.5-VL (its ViT with window attention and 2-D rotary, the patch merger, the
Qwen2 decoder with M-RoPE) and its Qwen2_5_VLProcessor, built in-process: the BPE test
tokenizer plus ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` and ``<|video_pad|>``,
and a Qwen2VLImageProcessor with 4-pixel patches.

Sizes: an image is resized to multiples of 8 pixels (patch 4 x merge 2) between MIN_PIXELS and
MAX_PIXELS, so images of different sizes give different token counts (e.g. 32x24 pixels: 8x6
patches, 4x3 = 12 tokens). A window is 2x2 merged tokens (window_size 16 pixels): a 4x3 grid
has four windows, one of them partial; block 1 of 3 attends to the whole image."""

from __future__ import annotations

import json
import os

from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

PATCH_SIZE, MERGE_SIZE = 4, 2
MIN_PIXELS, MAX_PIXELS = 8 * 8, 32 * 32  # at most 64 patches (16 tokens) an image
SPECIALS = {"vision_start": "<|vision_start|>", "image": "<|image_pad|>", "vision_end": "<|vision_end|>",
            "video": "<|video_pad|>"}


def make_tiny_qwen2_5_vl(path: str | os.PathLike, *, seed: int = 0) -> str:
    import torch
    from transformers import (AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessor)

    path = str(path)
    add_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS.values())})
    tok.save_pretrained(path)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in SPECIALS.items()}
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, window_size=16, out_hidden_size=32,
                  fullatt_block_indexes=[1], hidden_act="silu")
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["image"],
                              video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
                              vision_end_token_id=ids["vision_end"], bos_token_id=1, eos_token_id=2,
                              tie_word_embeddings=True)  # as Qwen2.5-VL-3B: no lm_head in the checkpoint
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # random weights of a visible scale, so images move the logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = Qwen2VLImageProcessor(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2,
                                            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    # As a published checkpoint: the image processor's file names Qwen2_5_VLProcessor (whose video
    # processor needs torchvision, so transformers cannot build it here; jaxlm's fallback runs).
    image_processor.save_pretrained(path)
    cfg_path = os.path.join(path, "preprocessor_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["processor_class"] = "Qwen2_5_VLProcessor"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def hf_inputs(path: str, prompt: str, images: list, **image_kwargs):
    """transformers' model inputs (torch) for a prompt and its images: the image processor's
    pixel_values and image_grid_thw, each image token expanded to grid.prod() / merge**2 of them
    (Qwen2_5_VLProcessor's rule, written out here), and mm_token_type_ids. image_kwargs: the
    image processor's options (what --mm-processor-kwargs sets)."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    tok, image_processor = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path, **image_kwargs)
    x = image_processor(images=images, return_tensors="pt") if images else {}
    text = prompt
    for grid in (x["image_grid_thw"] if images else []):
        text = text.replace(SPECIALS["image"], "<|placeholder|>" * (int(grid.prod()) // MERGE_SIZE ** 2), 1)
    ids = tok(text.replace("<|placeholder|>", SPECIALS["image"]), return_tensors="pt")["input_ids"]
    image_id = tok.convert_tokens_to_ids(SPECIALS["image"])
    return dict(input_ids=ids, mm_token_type_ids=(ids == image_id).to(torch.int32), **x)
