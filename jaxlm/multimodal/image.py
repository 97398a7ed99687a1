"""Images named by a chat ``image_url`` part (vLLM's MediaConnector): ``data:`` URLs (base64),
``http(s)://`` URLs fetched with a timeout and a byte cap (multimodal/fetch.py), and
``file://`` URLs under ``--allowed-local-media-path`` only. Every image is opened header first
and refused past MAX_IMAGE_PIXELS before its pixels are decoded (a decompression bomb is a
few KB of PNG that decodes to gigabytes)."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from jaxlm.multimodal.fetch import fetch_http_bytes, read_local_file

# A data URL this long is a denial of service, not an image (vLLM caps fetched media too).
MAX_DATA_URL_CHARS = 64 << 20
# The most pixels an image may decode to (40 megapixels: an 8K frame is 33 MP). PIL's own guard
# only warns below 89 MP; this check reads the header, so a bomb is refused before decoding.
MAX_IMAGE_PIXELS = 40_000_000


def load_image_url(url: Any, allowed_local_media_path: str | None = None) -> Any:
    """The PIL image of a data:, http(s): or file: URL; ValueError naming what is wrong.
    allowed_local_media_path: the directory file: URLs may read (None: they are refused)."""
    if not isinstance(url, str):
        raise ValueError(f"image_url.url must be a string, got {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url), "the data URL")
    if scheme in ("http", "https"):
        return decode_image(fetch_http_bytes(url), f"the image at {url}")
    if scheme == "file":
        return decode_image(read_local_file(url, allowed_local_media_path), f"the file {url}")
    raise ValueError(f"image_url: unsupported URL scheme {scheme or url[:16]!r}; give a data:, http(s): or "
                     "file: URL")


def _data_url_bytes(url: str) -> bytes:
    if len(url) > MAX_DATA_URL_CHARS:
        raise ValueError(f"image_url: the data URL holds {len(url)} characters; at most {MAX_DATA_URL_CHARS}")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("image_url: a data URL must be base64 encoded (data:<media type>;base64,<data>)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image_url: the data URL is not valid base64 ({e})") from None


def decode_image(raw: bytes, what: str) -> Any:
    """The decoded PIL image of ``raw``; ValueError for a non-image or one past MAX_IMAGE_PIXELS."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw))  # reads the header only
    except Image.DecompressionBombError as e:  # PIL's own guard, past ~179 MP
        raise ValueError(f"image_url: {what} is too large to decode ({e}); at most {MAX_IMAGE_PIXELS} pixels "
                         "are decoded") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"image_url: {what} is not a readable image ({e})") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"image_url: {what} is {width}x{height} = {width * height} pixels; at most "
                         f"{MAX_IMAGE_PIXELS} pixels are decoded")
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url: {what} is not a readable image ({e})") from None
    return image
