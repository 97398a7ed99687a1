"""Gemma 3 image inputs (Gemma3ForConditionalGeneration: SigLIP tower, average-pooled soft
tokens, the Gemma 3 decoder) through LLM.generate multi_modal_data: greedy tokens and logprobs
against transformers' generate on the same processor outputs, one engine shared by every test
(tiny random model, tests/helpers/tiny_gemma3_vision.py).

transformers (5.x, ``create_masks_for_vision_model``) lets an image's tokens attend to each
other both ways during prefill (``token_type_ids``); the engine must too, so these tests fail if
the image tokens were causal (test_image_tokens_attend_to_later_ones checks that directly).
The token budget (6) is smaller than the prompts: prefill is chunked, but never through an
image (disable_chunked_mm_input). TOL: float32 on both sides (summation order, ~1e-6)."""

from __future__ import annotations

import pytest

from jaxlm import LLM
from tests.helpers.tiny_gemma3_vision import TOKENS_PER_IMAGE, make_tiny_gemma3_vision
from tests.helpers.tiny_llava import random_image
from tests.helpers.vision_checks import check_against_hf, greedy_params, hf_greedy, max_logprob_diff

TOL = 1e-4
MAX_TOKENS = 6
BUDGET = 6
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=BUDGET, token_buckets=[BUDGET],
              seq_buckets=[4], num_gpu_blocks_override=32, block_size=8, enable_prefix_caching=True, seed=0,
              limit_mm_per_prompt={"image": 2})
ONE = "Look: <start_of_image> The capital of France is"
TWO = "A <start_of_image> and B <start_of_image> are"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3v"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path, **ENGINE)


@pytest.fixture(scope="module")
def hf(path):
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return model, AutoProcessor.from_pretrained(path)


def _hf_generate(hf, prompt, images, max_tokens, causal_images=False):
    """causal_images: without token_type_ids, so image tokens attend causally: the mask the engine
    must NOT use."""
    model, processor = hf
    x = processor(text=prompt, images=images, return_tensors="pt")
    if causal_images:
        x.pop("token_type_ids")
    return hf_greedy(model, x, max_tokens)


def _params(max_tokens=MAX_TOKENS):
    return greedy_params(max_tokens)


def _check_against_hf(out, hf, prompt, images):
    return check_against_hf(out, _hf_generate(hf, prompt, images, len(out.outputs[0].token_ids)), TOL)


def test_one_image_each_matches_transformers_and_the_image_matters(llm, hf):
    images = [random_image(0), random_image(1, size=(40, 30))]
    outs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": im}} for im in images], _params(),
                        use_tqdm=False)
    image_token = llm.llm_engine.model_config.hf_config.image_token_index
    assert outs[0].prompt_token_ids.count(image_token) == TOKENS_PER_IMAGE
    tokens = [_check_against_hf(o, hf, ONE, [im]) for o, im in zip(outs, images)]
    assert tokens[0] != tokens[1]  # the same text with another image: other tokens


def test_two_images_in_one_prompt(llm, hf):
    images = [random_image(2), random_image(3)]
    out, swapped = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": images}},
                                 {"prompt": TWO, "multi_modal_data": {"image": images[::-1]}}], _params(),
                                use_tqdm=False)
    assert _check_against_hf(out, hf, TWO, images) != _check_against_hf(swapped, hf, TWO, images[::-1])


def test_image_tokens_attend_to_later_ones(llm, hf):
    """The bidirectional mask is what transformers applies and it changes the logits: the
    engine is within TOL of it and far from transformers' output with causal image tokens."""
    image = random_image(4)
    [out] = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)
    _, _, bidirectional = _hf_generate(hf, ONE, [image], MAX_TOKENS)
    _, _, causal = _hf_generate(hf, ONE, [image], MAX_TOKENS, causal_images=True)
    assert max_logprob_diff(out, bidirectional) < TOL
    assert max_logprob_diff(out, causal) > 100 * TOL


def test_prefix_cache_reuses_the_same_image_never_another(llm, hf):
    """Blocks of 8: block 0 is text, block 1 (positions 8-15) holds the image (9-12). The same
    image hits both blocks; another image hits only the text block."""
    image, other = random_image(5), random_image(6)
    first = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)[0]
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    again = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits == 16
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    _check_against_hf(again, hf, ONE, [image])
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": other}}, _params(), use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits == 8
    _check_against_hf(out, hf, ONE, [other])


def test_chat_with_a_data_url_image_matches_transformers(llm, hf):
    """OpenAI's image_url part: Gemma3Processor's image_token (<start_of_image>) goes before the
    message's text, the processor expands it into its soft tokens."""
    import base64
    import io

    image, buf = random_image(7), io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in it?"}]}]
    [out] = llm.chat(messages, _params(), use_tqdm=False)
    rendered = "<s>user\n<start_of_image>\nWhat is in it?</s>\n<s>assistant\n"  # tiny_tokenizer's template
    _check_against_hf(out, hf, rendered, [image])


def test_engine_goes_on_with_no_leak_and_no_compile(llm):
    runner = llm.llm_engine.get_model_runner()
    assert llm.llm_engine.engine_config.scheduler_config.disable_chunked_mm_input
    assert runner.num_compiles_after_warmup == 0
    assert runner.encoder.cache == {} and runner.encoder._features == {}
    assert llm.llm_engine.get_stats()["kv_cache_usage_perc"] == 0.0
