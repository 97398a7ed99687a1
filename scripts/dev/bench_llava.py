"""LLaVA image requests end to end: jaxlm's LLM against transformers' generate on the same inputs.

A LLaVA-shaped model at LLaVA-1.5's shape ratios but small (random init, float32): a CLIP tower on
336x336 images with 14-pixel patches (576 image tokens per image), features from its second-last
layer, a two-layer projector and a Llama decoder. 8 requests, each one 336x336 image and a short
question, 64 greedy output tokens (ignore_eos). Each side is warmed up once on the same batch, then
timed over --rounds rounds, alternating; the median is reported (prefix caching off, so every
round encodes and prefills every image again). Then a repeated image on an engine with prefix
caching: a two-turn chat about one picture, one request at a time, the second turn's TTFT
(RequestOutput.metrics.first_token_latency) against the first's, medians over --rounds pictures.

    python scripts/dev/bench_llava.py [--rounds 3]
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
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

    add_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    # LLaVA-1.5-7B: CLIP-L/14-336 (1024 wide, 24 layers) and Llama 4096 wide, 32 layers; here / 8.
    config = LlavaConfig(
        text_config=LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=8, vocab_size=len(tok), max_position_embeddings=2048),
        vision_config=CLIPVisionConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                                       num_attention_heads=4, image_size=336, patch_size=14, projection_dim=128),
        image_token_index=tok.convert_tokens_to_ids("<image>"), image_seq_length=576, vision_feature_layer=-2,
        vision_feature_select_strategy="default")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path, safe_serialization=True)
    processor = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    LlavaProcessor(image_processor=processor, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()

    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from jaxlm import LLM, SamplingParams

    path = tempfile.mkdtemp(prefix="bench-llava-")
    make_model(path)
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((336, 336, 3)) * 255).astype(np.uint8)) for _ in range(args.num_requests)]
    prompts = [f"<s>user\n<image>\nWhat is in picture {i}?</s>\n<s>assistant\n" for i in range(args.num_requests)]
    n_out = args.output_len

    llm = LLM(model=path, max_num_seqs=args.num_requests, max_model_len=1024, max_num_batched_tokens=2048,
              token_buckets=[args.num_requests, 128, 2048], seq_buckets=[args.num_requests],
              limit_mm_per_prompt={"image": 1}, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)]

    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"

    def run_jaxlm() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    def run_hf() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        x = processor(text=prompts, images=images, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = hf.generate(**x, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, out[:, x["input_ids"].shape[1]:].tolist()

    run_jaxlm(), run_hf()  # warm-up (jaxlm compiled at start-up; torch's first call allocates)
    ours, theirs = [], []
    for _ in range(args.rounds):
        t, ours_tokens = run_jaxlm()
        ours.append(t)
        t, hf_tokens = run_hf()
        theirs.append(t)
    same = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
    j, h = statistics.median(ours), statistics.median(theirs)
    print(f"jaxlm {j:.2f} s, transformers {h:.2f} s (medians of {args.rounds}): {h / j:.2f}x; "
          f"greedy outputs equal for {same}/{len(prompts)} requests; "
          f"runs jaxlm {[round(t, 2) for t in ours]} transformers {[round(t, 2) for t in theirs]}")
    llm.llm_engine.shutdown()
    del llm

    cached = LLM(model=path, max_num_seqs=args.num_requests, max_model_len=1024, max_num_batched_tokens=2048,
                 token_buckets=[args.num_requests, 128, 2048], seq_buckets=[args.num_requests],
                 limit_mm_per_prompt={"image": 1}, enable_prefix_caching=True)
    first_ttft, second_ttft = [], []
    for r in range(args.rounds):
        turn1 = prompts[r]
        [out] = cached.generate({"prompt": turn1, "multi_modal_data": {"image": images[r]}}, params, use_tqdm=False)
        first_ttft.append(out.metrics.first_token_latency)
        turn2 = turn1 + out.outputs[0].text + "</s>\n<s>user\nAnd what colour is it?</s>\n<s>assistant\n"
        [out] = cached.generate({"prompt": turn2, "multi_modal_data": {"image": images[r]}}, params, use_tqdm=False)
        second_ttft.append(out.metrics.first_token_latency)
    f, s2 = statistics.median(first_ttft), statistics.median(second_ttft)
    print(f"repeated image: TTFT first turn {1e3 * f:.0f} ms, second turn {1e3 * s2:.0f} ms: {s2 / f:.2f}x "
          f"(runs {[round(1e3 * t) for t in first_ttft]} / {[round(1e3 * t) for t in second_ttft]} ms)")


if __name__ == "__main__":
    main()
