"""LLaVA image inputs through LLM.generate({"prompt": ..., "multi_modal_data": {"image": ...}}):
greedy tokens and logprobs against transformers' generate on the same processor outputs, one
engine shared by every test (tiny random LLaVA, tests/helpers/tiny_llava.py).

The engine's token budget (8) is half an image's 16 placeholder tokens: every prefill here is
chunked through the middle of an image, so the encoder cache must serve an image's rows over
several steps. 8 KV blocks of 16 tokens: four such requests at once preempt one another. TOL: float32 on both sides; the differences are summation order (~1e-6)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxlm import LLM, SamplingParams
from tests.helpers.tiny_llava import TOKENS_PER_IMAGE, make_tiny_llava, random_image
from tests.helpers.vision_checks import check_against_hf, greedy_params, hf_greedy

TOL = 1e-4
MAX_TOKENS = 6
BUDGET = 8
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=BUDGET, token_buckets=[BUDGET],
              seq_buckets=[4], num_gpu_blocks_override=8, block_size=16, enable_prefix_caching=True, seed=0,
              limit_mm_per_prompt={"image": 2})
ONE = "Look: <image> The capital of France is"
TWO = "A <image> and B <image> are"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """The directory chat file: URLs may read, holding image 7."""
    root = tmp_path_factory.mktemp("media")
    random_image(7).save(root / "seven.png")
    return root


@pytest.fixture(scope="module")
def llm(path, media):
    return LLM(model=path, allowed_local_media_path=str(media), **ENGINE)


@pytest.fixture(scope="module")
def hf(path):
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    return model, AutoProcessor.from_pretrained(path)


def _hf_generate(hf, prompt, images, max_tokens):
    model, processor = hf
    return hf_greedy(model, processor(text=prompt, images=images, return_tensors="pt"), max_tokens)


def _params(max_tokens=MAX_TOKENS):
    return greedy_params(max_tokens)


def _check_against_hf(out, hf, prompt, images):
    return check_against_hf(out, _hf_generate(hf, prompt, images, len(out.outputs[0].token_ids)), TOL)


def test_one_image_each_matches_transformers_and_the_image_matters(llm, hf):
    images = [random_image(0), random_image(1, size=(40, 30))]
    outs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": im}} for im in images], _params(),
                        use_tqdm=False)
    assert outs[0].prompt_token_ids.count(llm.llm_engine.model_config.hf_config.image_token_index) == TOKENS_PER_IMAGE
    tokens = [_check_against_hf(o, hf, ONE, [im]) for o, im in zip(outs, images)]
    # The same text with another image: other tokens (a test that fails if the image were ignored).
    assert tokens[0] != tokens[1]


def test_two_images_in_one_prompt(llm, hf):
    images = [random_image(2), random_image(3)]
    out, swapped = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": images}},
                                 {"prompt": TWO, "multi_modal_data": {"image": images[::-1]}}], _params(),
                                use_tqdm=False)
    assert _check_against_hf(out, hf, TWO, images) != _check_against_hf(swapped, hf, TWO, images[::-1])


def test_preempted_requests_are_encoded_again_and_still_match(llm, hf):
    """Four requests of 29 prompt + 20 output tokens (4 blocks each at the end) in 8 blocks: some
    are preempted, their encoder rows dropped, and recomputed from their images when they resume."""
    runner = llm.llm_engine.get_model_runner()
    preemptions, encoded = llm.llm_engine.scheduler.num_preemptions, runner.encoder.num_encoded
    images = [random_image(10 + i) for i in range(4)]
    outs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": im}} for im in images], _params(20),
                        use_tqdm=False)
    assert len(outs[0].prompt_token_ids) == 29 and len(outs[0].outputs[0].token_ids) == 20
    assert llm.llm_engine.scheduler.num_preemptions > preemptions
    assert runner.encoder.num_encoded > encoded + 4  # some images were encoded twice
    for out, im in zip(outs, images):
        _check_against_hf(out, hf, ONE, [im])


def _mm_delta(after: dict, before: dict) -> tuple[int, int]:
    return (after["mm_cache_queries"] - before["mm_cache_queries"], after["mm_cache_hits"] - before["mm_cache_hits"])


def test_mm_cache_counts_images_the_prefix_cache_spares_the_encoder(llm, hf):
    """vLLM's mm_cache_queries / mm_cache_hits: the image (positions 1-16) lies inside the two full
    blocks the second request finds cached, so it is a hit and the encoder does not run it."""
    prompt = "<image> The capital of France is Paris, the capital of Italy is Rome, and"
    image, runner = random_image(9), llm.llm_engine.get_model_runner()
    before = llm.llm_engine.get_stats()
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)[0]
    assert len(first.prompt_token_ids) > 2 * 16  # two full blocks to reuse
    mid, encoded = llm.llm_engine.get_stats(), runner.encoder.num_encoded
    assert _mm_delta(mid, before) == (1, 0)
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)[0]
    after = llm.llm_engine.get_stats()
    assert _mm_delta(after, mid) == (1, 1)
    assert runner.encoder.num_encoded == encoded  # the hit was never encoded
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    _check_against_hf(again, hf, prompt, [image])


def test_n_siblings_share_the_image_prefix(llm, hf):
    """n=2: the second sequence waits for the first's prompt blocks and reuses them (same image)."""
    image = random_image(8)
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, n=2)
    [out] = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, params, use_tqdm=False)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits == 16
    a, b = out.outputs
    assert list(a.token_ids) == list(b.token_ids) == _hf_generate(hf, ONE, [image], MAX_TOKENS)[1]


def test_prefix_cache_reuses_the_same_image_never_another(llm, hf):
    """The first block holds the text and half the image: the same image hits it, another misses."""
    image, other = random_image(4), random_image(5)
    first = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)[0]
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    again = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits == 16  # one block of 16 tokens
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": other}}, _params(), use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] == hits
    _check_against_hf(out, hf, ONE, [other])


def _data_url(image, fmt="PNG") -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(url, text="What is in it?"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def test_chat_with_a_data_url_image_matches_transformers(llm, hf):
    """OpenAI's image_url part (a PNG data URL): its placeholder goes before the message's text
    (as vLLM), the tiny tokenizer's template renders it, the processor expands it."""
    image = random_image(7)
    [out] = llm.chat(_chat(_data_url(image)), _params(), use_tqdm=False)
    rendered = "<s>user\n<image>\nWhat is in it?</s>\n<s>assistant\n"  # tests/helpers/tiny_tokenizer.py's template
    _check_against_hf(out, hf, rendered, [image])


def test_chat_with_a_file_url_under_allowed_local_media_path(llm, hf, media):
    """LLM(allowed_local_media_path=...): a file: URL inside it is read; one outside is refused."""
    [out] = llm.chat(_chat(f"file://{media}/seven.png"), _params(), use_tqdm=False)
    _check_against_hf(out, hf, "<s>user\n<image>\nWhat is in it?</s>\n<s>assistant\n", [random_image(7)])
    with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
        llm.chat(_chat(f"file://{media}/../seven.png"), _params(), use_tqdm=False)


@pytest.mark.parametrize("url,message", [
    ("data:image/png;base64,@@not base64@@", "not valid base64"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not a readable image"),
    ("ftp://example.com/cat.png", "unsupported URL scheme 'ftp'"),
    ("file://localhost.example/x.png", "must name a local absolute path"),
])
def test_bad_chat_image_fails_alone(llm, url, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(_chat(url), _params(), use_tqdm=False)


@pytest.mark.parametrize("data,message", [
    ({"image": "not an image"}, r"multi_modal_data\['image'\]\[0\] must be a PIL.Image.Image, got str"),
    ({"image": [None]}, r"must be a PIL.Image.Image, got NoneType"),
    ({"audio": b"x"}, "with the key 'image'"),
])
def test_bad_multimodal_data_fails_alone(llm, data, message):
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt": ONE, "multi_modal_data": data}, _params(), use_tqdm=False)


def test_limits_and_placeholder_count_are_checked(llm):
    three = [random_image(i) for i in range(3)]
    with pytest.raises(ValueError, match=r"At most 2 image\(s\) may be provided in one prompt, got 3"):
        llm.generate({"prompt": "<image>" * 3, "multi_modal_data": {"image": three}}, _params(), use_tqdm=False)
    with pytest.raises(ValueError, match="processor refused|placeholder"):
        llm.generate({"prompt": "no placeholder here", "multi_modal_data": {"image": three[0]}}, _params(),
                     use_tqdm=False)


def test_engine_goes_on_with_no_leak_and_no_compile(llm, hf):
    """After every refusal above: a request is served, nothing compiled while serving, and the
    encoder cache and the KV blocks held by requests are all released."""
    out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": random_image(6)}}, _params(), use_tqdm=False)[0]
    _check_against_hf(out, hf, ONE, [random_image(6)])
    runner = llm.llm_engine.get_model_runner()
    assert runner.num_compiles_after_warmup == 0
    assert runner.encoder.cache == {} and runner.encoder._features == {}
    assert llm.llm_engine.get_stats()["kv_cache_usage_perc"] == 0.0
    assert np.isclose(runner.encoder.num_encoded, runner.encoder.num_encoded)  # counter exists
