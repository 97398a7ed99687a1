"""Qwen2.5-VL image inputs (its ViT with window attention and 2-D rotary, the patch merger,
M-RoPE in the Qwen2 decoder) through LLM.generate multi_modal_data and LLM.chat: greedy tokens
and logprobs against transformers' generate on the same image-processor outputs, one engine
shared by every test (tiny random model, tests/helpers/tiny_qwen2_5_vl.py).

Images of different sizes give different token counts (dynamic resolution): 16x24 pixels -> 2x3
= 6 tokens, 24x32 -> 3x4 = 12 (four 2x2 windows, two of them partial). The token budget (16) is
smaller than the prompts: prefill is chunked through the middle of an image (the encoder cache
serves its rows over two steps, the M-RoPE table its positions). 12 KV blocks of 8: the four
requests of the preemption test cannot all fit. TOL: float32 on both sides (~1e-6 seen)."""

from __future__ import annotations

import pytest

from jaxlm import LLM
from tests.helpers.tiny_llava import random_image
from tests.helpers.tiny_qwen2_5_vl import hf_inputs, make_tiny_qwen2_5_vl
from tests.helpers.vision_checks import check_against_hf, greedy_params, hf_greedy

TOL = 1e-4
MAX_TOKENS = 6
BUDGET = 16
ENGINE = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=BUDGET, token_buckets=[BUDGET],
              seq_buckets=[4], num_gpu_blocks_override=12, block_size=8, enable_prefix_caching=True, seed=0,
              limit_mm_per_prompt={"image": 2})
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"Look {IMAGE} the capital"
TWO = f"A {IMAGE} and B {IMAGE} are"
SMALL, LARGE = (16, 24), (24, 32)  # (height, width) in pixels: 6 and 12 tokens


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path, **ENGINE)


@pytest.fixture(scope="module")
def hf(path):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    return model, path


def _hf_generate(hf, prompt, images, max_tokens):
    model, path = hf
    return hf_greedy(model, hf_inputs(path, prompt, images), max_tokens)


def _params(max_tokens=MAX_TOKENS):
    return greedy_params(max_tokens)


def _check_against_hf(out, hf, prompt, images):
    return check_against_hf(out, _hf_generate(hf, prompt, images, len(out.outputs[0].token_ids)), TOL)


def _image_tokens(llm, out) -> list[int]:
    image_id = llm.llm_engine.model_config.hf_config.image_token_id
    return [i for i, t in enumerate(out.prompt_token_ids) if t == image_id]


def test_images_of_different_sizes_match_transformers_and_the_image_matters(llm, hf):
    images = [random_image(0, size=LARGE), random_image(1, size=LARGE), random_image(2, size=SMALL)]
    outs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": im}} for im in images], _params(),
                        use_tqdm=False)
    where = _image_tokens(llm, outs[0])
    assert len(where) == 12 and where[0] < BUDGET < where[-1] + 1  # the first chunk ends inside the image
    assert len(_image_tokens(llm, outs[2])) == 6
    tokens = [_check_against_hf(o, hf, ONE, [im]) for o, im in zip(outs, images)]
    assert tokens[0] != tokens[1]  # the same text with another image: other tokens


def test_two_images_of_different_sizes_in_one_prompt(llm, hf):
    images = [random_image(3, size=SMALL), random_image(4, size=LARGE)]
    out, swapped = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": images}},
                                 {"prompt": TWO, "multi_modal_data": {"image": images[::-1]}}], _params(),
                                use_tqdm=False)
    assert len(_image_tokens(llm, out)) == 18
    assert _check_against_hf(out, hf, TWO, images) != _check_against_hf(swapped, hf, TWO, images[::-1])


def test_text_only_prompt_matches_transformers(llm, hf):
    [out] = llm.generate("The capital of France is", _params(), use_tqdm=False)
    _check_against_hf(out, hf, "The capital of France is", [])


def test_preempted_requests_get_their_rows_and_positions_again(llm, hf):
    """Four requests of 21 prompt + 12 output tokens (5 blocks each at the end) in 12 blocks: some
    are preempted, their encoder rows and M-RoPE tables dropped, and rebuilt when they resume."""
    runner = llm.llm_engine.get_model_runner()
    preemptions, encoded = llm.llm_engine.scheduler.num_preemptions, runner.encoder.num_encoded
    images = [random_image(10 + i, size=LARGE) for i in range(4)]
    outs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": im}} for im in images], _params(12),
                        use_tqdm=False)
    assert len(outs[0].prompt_token_ids) == 21 and len(outs[0].outputs[0].token_ids) == 12
    assert llm.llm_engine.scheduler.num_preemptions > preemptions
    assert runner.encoder.num_encoded > encoded + 4  # some images were encoded twice
    for out, im in zip(outs, images):
        _check_against_hf(out, hf, ONE, [im])


def test_prefix_cache_reuses_the_same_image_never_another(llm, hf):
    """Blocks of 8: both full blocks of the 21-token prompt hold image tokens (5-16). The same
    image hits both; another image of the same size hits none."""
    image, other = random_image(5, size=LARGE), random_image(6, size=LARGE)
    first = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)[0]
    encoder = llm.llm_engine.get_model_runner().encoder
    hits, encoded = llm.llm_engine.get_stats()["prefix_cache_hits"], encoder.num_encoded
    again = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits == 16
    # The hit covers the image's first 11 tokens, not its last: the image is encoded again for it.
    assert encoder.num_encoded == encoded + 1
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    _check_against_hf(again, hf, ONE, [image])
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": other}}, _params(), use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] == hits
    _check_against_hf(out, hf, ONE, [other])


def test_chat_with_a_data_url_image_matches_transformers(llm, hf):
    """OpenAI's image_url part: Qwen2-VL's placeholder (the image token between the vision start
    and end tokens, as vLLM) before the message's text; the image processor and the expansion run
    without transformers' Qwen2_5_VLProcessor, which needs torchvision."""
    import base64
    import io

    image, buf = random_image(7, size=SMALL), io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in it?"}]}]
    [out] = llm.chat(messages, _params(), use_tqdm=False)
    rendered = f"<s>user\n{IMAGE}\nWhat is in it?</s>\n<s>assistant\n"  # tiny_tokenizer's template
    _check_against_hf(out, hf, rendered, [image])


def test_bad_input_fails_alone(llm):
    with pytest.raises(ValueError, match=r"holds 0 image placeholder\(s\) \(<\|image_pad\|>\) for 1 image"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": random_image(8)}}, _params(),
                     use_tqdm=False)
    three = [random_image(i, size=SMALL) for i in range(3)]
    with pytest.raises(ValueError, match=r"At most 2 image\(s\)"):
        llm.generate({"prompt": IMAGE * 3, "multi_modal_data": {"image": three}}, _params(), use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_pixel": 384}, r"mm_processor_kwargs: Qwen2VLImageProcessor\w* takes no option 'max_pixel'; it takes: .*max_pixels"),
    ({"max_pixels": 8}, r"max_pixels .* must be an integer of at least one patch \(16 pixels\), got 8"),
])
def test_processor_options_that_cannot_work_fail_the_start(path, kwargs, message):
    # --mm-processor-kwargs' effect on images: tests/serve/test_qwen2_5_vl_server.py
    with pytest.raises(ValueError, match=message):
        LLM(model=path, mm_processor_kwargs=kwargs, **ENGINE)


def test_engine_goes_on_with_no_leak_and_no_compile(llm, hf):
    """After every test above: nothing compiled while serving, the encoder cache empty, and the
    M-RoPE tables of finished requests dropped (the runner hears of a finish at the next step:
    a text-only request here)."""
    runner = llm.llm_engine.get_model_runner()
    assert runner.encoder.buckets == [64, 128]  # 2 images of at most 64 patches (MAX_PIXELS)
    [out] = llm.generate("The capital of Italy is", _params(), use_tqdm=False)
    _check_against_hf(out, hf, "The capital of Italy is", [])
    assert runner.num_compiles_after_warmup == 0
    assert runner.encoder.cache == {} and runner.encoder._features == {}
    assert runner.mrope._tables == {}
    assert llm.llm_engine.get_stats()["kv_cache_usage_perc"] == 0.0
