"""The image URL loader's limits without an engine (multimodal/image.py, fetch.py): a local
http.server answering redirects and bodies past the byte cap, file: URLs without an allowed
directory, and the config's check of that directory. The engine paths (server and LLM) are
tests/serve/test_llava_server.py and tests/models/test_llava.py."""

from __future__ import annotations

import http.server
import io
import os
import struct
import threading
import zlib

import pytest

from jaxlm.config.model import ModelConfig
from jaxlm.multimodal import fetch
from jaxlm.multimodal.image import decode_image, load_image_url


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def web():
    """/img.png, /loop (redirects to itself), /to-img (redirects to /img.png), /stream (the
    image sent chunked, no Content-Length)."""
    png = _png()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path in ("/loop", "/to-img"):
                self.send_response(302)
                self.send_header("Location", "/loop" if self.path == "/loop" else "/img.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/img.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            else:  # /stream
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(0, len(png), 64):
                    part = png[i:i + 64]
                    self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}", len(png)
    httpd.shutdown()
    httpd.server_close()


def test_redirects_are_followed_up_to_the_limit(web):
    assert load_image_url(web[0] + "/to-img").size == (8, 8)
    with pytest.raises(ValueError, match=f"more than {fetch.MAX_REDIRECTS} redirects"):
        load_image_url(web[0] + "/loop")


def test_bodies_past_the_byte_cap_are_refused(web, monkeypatch):
    base, size = web
    assert load_image_url(base + "/stream").size == (8, 8)
    monkeypatch.setattr(fetch, "MAX_FETCH_BYTES", size - 1)
    with pytest.raises(ValueError, match=f"is {size} bytes; at most {size - 1}"):  # declared length
        load_image_url(base + "/img.png")
    with pytest.raises(ValueError, match=f"more than {size - 1} bytes"):  # counted while streaming
        load_image_url(base + "/stream")


def test_fetch_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("VLLM_IMAGE_FETCH_TIMEOUT", raising=False)
    assert fetch.fetch_timeout_s() == 5.0
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2.5")
    assert fetch.fetch_timeout_s() == 2.5
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT must be a number"):
        load_image_url("http://127.0.0.1:9/x.png")


def _png_header(width: int, height: int) -> bytes:
    """A PNG of its signature, IHDR and an empty IDAT: PIL opens it lazily and knows its size."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"")


@pytest.mark.parametrize("size,message", [
    ((8000, 7000), r"8000x7000 = 56000000 pixels; at most 40000000 pixels are decoded"),  # our limit
    ((20000, 20000), r"too large to decode .*; at most 40000000 pixels"),  # past PIL's own guard
])
def test_images_past_the_pixel_limit_are_refused_before_decoding(size, message):
    with pytest.raises(ValueError, match=message):
        decode_image(_png_header(*size), "the image")


def test_file_urls_need_an_allowed_directory(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    with pytest.raises(ValueError, match="without --allowed-local-media-path"):
        load_image_url(f"file://{tmp_path}/a.png")
    assert load_image_url(f"file://{tmp_path}/a.png", str(tmp_path)).size == (8, 8)
    with pytest.raises(ValueError, match="cannot read"):
        load_image_url(f"file://{tmp_path}/missing.png", str(tmp_path))
    with pytest.raises(ValueError, match="is not an existing directory"):
        ModelConfig(allowed_local_media_path=str(tmp_path / "a.png"))
    real = os.path.realpath(tmp_path)
    assert ModelConfig(allowed_local_media_path=str(tmp_path / ".")).allowed_local_media_path == real
