"""Images named by a chat ``image_url`` part. Only ``data:`` URLs (base64) are read yet: fetching
http(s) URLs and local files needs a timeout, a size cap and --allowed-local-media-path, which are
not built, so those are refused with a message that says so."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

# A data URL this long is a denial of service, not an image (vLLM caps fetched media too).
MAX_DATA_URL_CHARS = 64 << 20


def load_image_url(url: Any) -> Any:
    """The PIL image of a ``data:image/...;base64,...`` URL; ValueError naming what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str):
        raise ValueError(f"image_url.url must be a string, got {type(url).__name__}")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ValueError(f"image_url: only data: URLs (data:image/png;base64,...) are supported yet, got a "
                         f"{scheme!r} URL")
    if len(url) > MAX_DATA_URL_CHARS:
        raise ValueError(f"image_url: the data URL holds {len(url)} characters; at most {MAX_DATA_URL_CHARS}")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("image_url: a data URL must be base64 encoded (data:<media type>;base64,<data>)")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image_url: the data URL is not valid base64 ({e})") from None
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url: the data is not a readable image ({e})") from None
    return image
