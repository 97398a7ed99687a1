"""A tiny random Gemma 3 with images (SigLIP tower + Gemma 3 decoder) and its Gemma3Processor,
built in-process: the BPE test tokenizer plus ``<start_of_image>``, ``<image_soft_token>`` and
``<end_of_image>``, and a Gemma3ImageProcessor sized to the tower."""

from __future__ import annotations

import os

from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

IMAGE_SIZE, PATCH_SIZE = 16, 4  # 4x4 patches, average-pooled 2x2 to 4 soft tokens per image
TOKENS_PER_IMAGE = 4
SLIDING_WINDOW = 8  # shorter than a prompt: the sliding layers' window cuts through images too


def make_tiny_gemma3_vision(path: str | os.PathLike, *, seed: int = 0) -> str:
    import torch
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)

    path = str(path)
    add_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    specials = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok.add_special_tokens({"additional_special_tokens": list(specials.values())})
    tok.save_pretrained(path)
    # Gemma3Processor reads tokenizer.boi_token etc.: named special tokens, saved with it.
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens=specials)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in specials.items()}
    text = Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, vocab_size=len(tok), sliding_window=SLIDING_WINDOW,
                            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256)
    vision = SiglipVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
                          eoi_token_index=ids["eoi_token"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # random weights of a visible scale, so images move the logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Gemma3Processor(image_processor=image_processor, tokenizer=tok,
                    image_seq_length=TOKENS_PER_IMAGE).save_pretrained(path)
    return path

