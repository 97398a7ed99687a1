"""Images through /v1/chat/completions with the openai client: OpenAI image_url parts holding
data URLs, http URLs (a local http.server) and file URLs under --allowed-local-media-path, on a
tiny random LLaVA whose engine core runs in its own process (the images cross to it in the
msgpack messages). The greedy text equals transformers' on the same rendered prompt; every
refusal (a bad URL, a hanging or missing one, a file outside the directory, a decompression
bomb) is a 400 in OpenAI's error shape and the server keeps serving."""

from __future__ import annotations

import base64
import os
import socket

import pytest

from tests.helpers.http_files import png_bytes, serve_files
from tests.helpers.tiny_llava import make_tiny_llava, random_image
from tests.serve.conftest import metric, serve_engine

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 5
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, token_buckets=[32], seq_buckets=[4],
              num_gpu_blocks_override=32, limit_mm_per_prompt={"image": 1})


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """The allowed directory: an image, a decompression bomb (8000x7000 1-bit PNG, ~7 KB that
    decodes to 56 megapixels) and a symlink to an image outside it."""
    from PIL import Image

    root, outside = tmp_path_factory.mktemp("media"), tmp_path_factory.mktemp("outside")
    random_image(3).save(root / "cat.png")
    random_image(3).save(outside / "secret.png")
    Image.new("1", (8000, 7000)).save(root / "bomb.png", optimize=True)
    os.symlink(outside / "secret.png", root / "link.png")
    return root, outside


@pytest.fixture(scope="module")
def server(path, media):
    srv = serve_engine(path, ["--served-model-name", "llava"], allowed_local_media_path=str(media[0]), **ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def web():
    """A local http.server: /cat.png (image 3), /text (a non-image body), anything else 404; and a
    socket that accepts connections (the kernel's backlog) and never answers."""
    bodies = {"/cat.png": (png_bytes(random_image(3)), "image/png"),
              "/text": (b"<html>not an image</html>", "text/html")}
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    with serve_files(bodies) as base:
        yield base, f"http://127.0.0.1:{hang.getsockname()[1]}/cat.png"
    hang.close()


def _url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


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
    assert metric(server.metrics(), "vllm:mm_cache_queries_total") == 0  # at rest: the series, at zero
    assert metric(server.metrics(), "vllm:mm_cache_hits_total") == 0
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
    assert metric(server.metrics(), "vllm:mm_cache_queries_total") == 2  # one image per request


@pytest.mark.parametrize("urls,message", [
    (["data:image/png;base64,%%%"], "not valid base64"),
    (["data:image/png;base64," + base64.b64encode(b"not an image").decode()], "not a readable image"),
    (["ftp://127.0.0.1/cat.png"], "unsupported URL scheme 'ftp'"),
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


def _chat_text(client, url: str) -> str:
    out = client.chat.completions.create(model="llava", messages=_messages(url), max_tokens=MAX_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    return out.choices[0].message.content


def test_http_and_file_urls_give_the_data_url_text(server, media, web):
    """The same image as a data URL, an http URL and a file URL inside --allowed-local-media-path
    (also through a `..` that stays inside): the same greedy text."""
    client = server.client()
    expected = _chat_text(client, _url(random_image(3)))
    assert _chat_text(client, web[0] + "/cat.png") == expected
    assert _chat_text(client, f"file://{media[0]}/cat.png") == expected
    assert _chat_text(client, f"file://{media[0]}/../{media[0].name}/cat.png") == expected


def test_bad_fetched_images_get_a_400_and_the_server_goes_on(server, media, web, monkeypatch):
    import re

    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "1")  # read per fetch (vLLM's variable)
    root, outside = media
    cases = [
        (web[1], r"timed out after 1 s \(VLLM_IMAGE_FETCH_TIMEOUT\)"),
        (web[0] + "/missing.png", "HTTP 404"),
        (web[0] + "/text", "is not a readable image"),
        (f"file://{outside}/secret.png", "outside --allowed-local-media-path"),
        (f"file://{root}/../{outside.name}/secret.png", "outside --allowed-local-media-path"),
        (f"file://{root}/link.png", "outside --allowed-local-media-path"),  # a symlink escaping
        (f"file://{root}/bomb.png", r"8000x7000 = 56000000 pixels; at most 40000000"),
    ]
    with server.http() as http:
        for url, message in cases:
            r = http.post("/v1/chat/completions", json={"model": "llava", "messages": _messages(url), "max_tokens": 2})
            assert r.status_code == 400, (url, r.text)
            error = r.json()["error"]
            assert re.search(message, error["message"]) and error["type"] == "BadRequestError", (url, error)
            assert error["param"] == "messages", error
        ok = http.post("/v1/chat/completions", json={"model": "llava", "max_tokens": 2,
                                                      "messages": _messages(_url(random_image(0)))})
        assert ok.status_code == 200, ok.text
