"""Qwen2.5-VL images through /v1/chat/completions with the openai client, the engine core in its
own process (each image's patches and patch grid cross to it in the msgpack messages): a data
URL and the same image over http give transformers' greedy text on the rendered prompt (the
placeholder is Qwen2-VL's vision start / image / vision end tokens); a prompt with an unusable
image is a 400 and the server goes on. The server runs with --mm-processor-kwargs '{"max_pixels":
384}': a 24x32 image (768 pixels, 12 tokens by the checkpoint's own processor) becomes 16x16 pixels,
4 tokens, as transformers' image processor makes it with the same option. The other refusals are the model-independent chat path's
(test_llava_server.py)."""

from __future__ import annotations

import base64

import pytest

from tests.helpers.http_files import png_bytes, serve_files
from tests.helpers.tiny_llava import random_image
from tests.helpers.tiny_qwen2_5_vl import hf_inputs, make_tiny_qwen2_5_vl
from tests.serve.conftest import serve_engine

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 5
PROCESSOR_KWARGS = {"max_pixels": 384}
ENGINE = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, token_buckets=[32], seq_buckets=[2],
              num_gpu_blocks_override=16, limit_mm_per_prompt={"image": 1})
RENDERED = "<s>user\n<|vision_start|><|image_pad|><|vision_end|>\nWhat is it?</s>\n<s>assistant\n"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def server(path):
    srv = serve_engine(path, ["--served-model-name", "qwen"], mm_processor_kwargs=PROCESSOR_KWARGS, **ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def web():
    """A local http.server with /cat.png (image 3, 24x32 pixels)."""
    with serve_files({"/cat.png": (png_bytes(random_image(3, size=(24, 32))), "image/png")}) as base:
        yield f"{base}/cat.png"


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}]


def _hf_text(path: str, image) -> str:
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    x = hf_inputs(path, RENDERED, [image], **PROCESSOR_KWARGS)
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return AutoTokenizer.from_pretrained(path).decode(out[0, x["input_ids"].shape[1]:])


def _chat(client, url: str):
    return client.chat.completions.create(model="qwen", messages=_messages(url), max_tokens=MAX_TOKENS,
                                          temperature=0.0, extra_body={"ignore_eos": True})


def test_data_and_http_url_images_match_transformers(server, path, web):
    client = server.client()
    image = random_image(3, size=(24, 32))
    out = _chat(client, "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode())
    assert out.choices[0].message.content == _hf_text(path, image)
    # The placeholder expanded to the resized image's 2x2 tokens, not the checkpoint default's 3x4.
    assert out.usage.prompt_tokens == hf_inputs(path, RENDERED, [image], **PROCESSOR_KWARGS)["input_ids"].shape[1]
    assert out.usage.prompt_tokens == hf_inputs(path, RENDERED, [image])["input_ids"].shape[1] - 8
    assert _chat(client, web).choices[0].message.content == out.choices[0].message.content
    other = _chat(client, "data:image/png;base64," + base64.b64encode(png_bytes(random_image(4, size=(24, 32)))).decode())
    assert other.choices[0].message.content != out.choices[0].message.content  # the image is read
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={"model": "qwen", "max_tokens": 2,
                                                 "messages": _messages("data:image/png;base64,aGVsbG8=")})
        assert r.status_code == 400 and "not a readable image" in r.json()["error"]["message"], r.text
    assert _chat(client, web).choices[0].message.content == out.choices[0].message.content
