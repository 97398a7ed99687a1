"""Images through /v1/chat/completions with the openai client: OpenAI image_url parts holding
data URLs, on a tiny random LLaVA whose engine core runs in its own process (the images cross
to it in the msgpack messages). The greedy text equals transformers' on the same rendered
prompt; every refusal is a 400 in OpenAI's error shape and the server keeps serving."""

from __future__ import annotations

import base64
import io

import pytest

from tests.helpers.tiny_llava import make_tiny_llava, random_image
from tests.serve.conftest import serve_engine

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 5
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, token_buckets=[32], seq_buckets=[4],
              num_gpu_blocks_override=32, limit_mm_per_prompt={"image": 1})


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def server(path):
    srv = serve_engine(path, ["--served-model-name", "llava"], **ENGINE)
    yield srv
    srv.stop()


def _url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def _hf_text(path: str, image) -> str:
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    x = processor(text="<s>user\n<image>\nWhat is it?</s>\n<s>assistant\n", images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return processor.tokenizer.decode(out[0, x["input_ids"].shape[1]:])


def test_chat_with_data_url_images_matches_transformers(server, path):
    client = server.client()
    texts = []
    for seed in (0, 1):
        image = random_image(seed)
        out = client.chat.completions.create(model="llava", messages=_messages(_url(image)), max_tokens=MAX_TOKENS,
                                             temperature=0.0, extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == _hf_text(path, image)
        assert out.usage.prompt_tokens > 16  # the placeholder expanded to the image's 16 tokens
        texts.append(out.choices[0].message.content)
    assert texts[0] != texts[1]  # the image is read


@pytest.mark.parametrize("urls,message", [
    (["data:image/png;base64,%%%"], "not valid base64"),
    (["data:image/png;base64," + base64.b64encode(b"not an image").decode()], "not a readable image"),
    (["http://127.0.0.1:9/cat.png"], "only data: URLs"),
    ([_url(random_image(0))] * 2, r"At most 1 image\(s\)"),
])
def test_bad_images_get_a_400_and_the_server_goes_on(server, urls, message):
    import re

    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "llava", "messages": _messages(*urls), "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert re.search(message, error["message"]) and error["type"] == "BadRequestError", error
        ok = http.post("/v1/chat/completions", json={"model": "llava", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text
