"""Qwen2.5-VL's vision encoder: jaxlm's bucketed program against transformers' ``visual`` forward
on the same weights and the same image-processor outputs, and the host cost of M-RoPE positions.

A Qwen2.5-VL tower at the published width (hidden 1280, 16 heads, MLP 3420, 14-pixel patches,
2x2 merge, 112-pixel windows) but 8 blocks (full attention at 3 and 7), random init, float32,
under a tiny text decoder; max_pixels 448x448, one image a prompt (encoder buckets 64..1024
patches). Images of 224x224 (256 patches) and 448x448 (1024 patches): each side --rounds times,
alternating, medians; the largest difference of the merged rows is printed beside them. Then
``MRopePositions.step_positions`` per call: a 256-token step of two requests, one with an image
table, and a text-only decode step.

    python scripts/dev/bench_qwen2_5_vl_encoder.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def make_model(path: str) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from tests.helpers.tiny_qwen2_5_vl import SPECIALS
    from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

    add_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS.values())})
    tok.save_pretrained(path)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in SPECIALS.items()}
    text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    vision = dict(depth=8, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=256,
                  fullatt_block_indexes=[3, 7])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["image"],
                              video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
                              vision_end_token_id=ids["vision_end"])
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path, safe_serialization=True)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=448 * 448).save_pretrained(path)


def bench_encoder(path: str, rounds: int) -> None:
    import numpy as np
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from jaxlm import LLM
    from jaxlm.multimodal.processing import MultiModalProcessor
    from tests.helpers.tiny_llava import random_image

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, max_num_seqs=2, max_model_len=512, max_num_batched_tokens=256, token_buckets=[256],
              seq_buckets=[2], num_gpu_blocks_override=64, limit_mm_per_prompt={"image": 1})
    runner = llm.llm_engine.get_model_runner()
    processor = MultiModalProcessor(path, llm.llm_engine.model_config.hf_config, {"image": 1})
    print("encoder buckets (patches):", runner.encoder.buckets)
    for size in [(224, 224), (448, 448)]:
        _, [f] = processor.process("<|vision_start|><|image_pad|><|vision_end|>", [random_image(0, size=size)])
        pixels, grid = torch.from_numpy(f.data), torch.tensor([f.grid_thw])
        ours, ref = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            rows = runner.encoder._encode(runner._param_leaves, [f])[0]
            ours.append(time.perf_counter() - t)
            with torch.no_grad():
                t = time.perf_counter()
                out = hf.model.visual(pixels, grid_thw=grid).pooler_output.numpy()
                ref.append(time.perf_counter() - t)
        print(f"{size[0]}x{size[1]}: {len(f.data)} patches, {len(rows)} tokens; jaxlm encoder "
              f"{1e3 * statistics.median(ours):.0f} ms, transformers visual {1e3 * statistics.median(ref):.0f} ms "
              f"(medians of {rounds}); max |diff| {np.abs(rows - out).max():.1e} of max |row| {np.abs(out).max():.1f}")


def bench_positions() -> None:
    from types import SimpleNamespace

    import numpy as np

    from jaxlm.multimodal.mrope import mrope_input_positions
    from jaxlm.worker.mrope_positions import MRopePositions

    m = MRopePositions(2)
    m._tables["a"] = mrope_input_positions(300, [(5, 256, (1, 32, 32))], 2)
    step = SimpleNamespace(req_ids=["a", "b"], query_start_loc=np.array([0, 128, 256]),
                           positions=np.concatenate([np.arange(100, 228), np.arange(128)]).astype(np.int32))
    decode = SimpleNamespace(req_ids=["b"], query_start_loc=np.array([0, 1]), positions=np.zeros(4, np.int32))
    for name, runner, inputs, T, n in [("256-token step, one image table", m, step, 256, 2000),
                                       ("text-only decode step", MRopePositions(2), decode, 4, 20000)]:
        t = time.perf_counter()
        for _ in range(n):
            runner.step_positions(inputs, T)
        print(f"step_positions, {name}: {1e6 * (time.perf_counter() - t) / n:.1f} us a call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as path:
        make_model(path)
        bench_encoder(path, args.rounds)
    bench_positions()


if __name__ == "__main__":
    main()
