"""The bytes of an image URL that is not a data URL (vLLM's MediaConnector): http(s) fetched
with httpx under a deadline (``VLLM_IMAGE_FETCH_TIMEOUT``, seconds, default 5, read per fetch),
at most MAX_FETCH_BYTES and MAX_REDIRECTS redirects; a ``file://`` path read only inside
``allowed_local_media_path``, after resolving ``..`` and symlinks. Each failure is a ValueError
naming the URL and the problem. Blocking: the server calls it on a worker thread (rendering
runs off the event loop, serve/chat_template.py)."""

from __future__ import annotations

import os
import time
import urllib.parse
import urllib.request

# The most bytes one image download (or local image file) may hold.
MAX_FETCH_BYTES = 32 << 20
MAX_REDIRECTS = 5
DEFAULT_FETCH_TIMEOUT_S = 5.0


def fetch_timeout_s() -> float:
    """``VLLM_IMAGE_FETCH_TIMEOUT`` (vLLM's variable), read now so a deployment may change it."""
    raw = os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT")
    try:
        value = float(raw) if raw else DEFAULT_FETCH_TIMEOUT_S
    except ValueError:
        raise ValueError(f"VLLM_IMAGE_FETCH_TIMEOUT must be a number of seconds, got {raw!r}") from None
    return value if value > 0 else DEFAULT_FETCH_TIMEOUT_S


def fetch_http_bytes(url: str) -> bytes:
    """The body of an http(s) URL: a 2xx answer within the deadline and the byte cap."""
    import httpx

    timeout = fetch_timeout_s()
    deadline = time.monotonic() + timeout
    try:
        # Per-operation timeouts bound a silent peer; the deadline bounds one that trickles.
        with httpx.Client(timeout=timeout, follow_redirects=True, max_redirects=MAX_REDIRECTS) as client:
            with client.stream("GET", url) as response:
                if response.status_code >= 400:
                    raise ValueError(f"image_url: fetching {url} failed: HTTP {response.status_code} "
                                     f"{response.reason_phrase}")
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > MAX_FETCH_BYTES:
                    raise ValueError(f"image_url: {url} is {declared} bytes; at most {MAX_FETCH_BYTES} are fetched")
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > MAX_FETCH_BYTES:
                        raise ValueError(f"image_url: {url} is more than {MAX_FETCH_BYTES} bytes; at most "
                                         f"{MAX_FETCH_BYTES} are fetched")
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("deadline")
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.TimeoutException:
        raise ValueError(f"image_url: fetching {url} timed out after {timeout:g} s "
                         "(VLLM_IMAGE_FETCH_TIMEOUT)") from None
    except httpx.TooManyRedirects:
        raise ValueError(f"image_url: fetching {url} followed more than {MAX_REDIRECTS} redirects") from None
    except httpx.HTTPError as e:
        raise ValueError(f"image_url: fetching {url} failed: {type(e).__name__}: {e}") from None


def read_local_file(url: str, allowed_local_media_path: str | None) -> bytes:
    """The bytes of a ``file:///abs/path`` URL whose real path lies inside the allowed directory."""
    if not allowed_local_media_path:
        raise ValueError(f"image_url: cannot load local files ({url}) without --allowed-local-media-path "
                         "(allowed_local_media_path for LLM)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"image_url: a file URL must name a local absolute path (file:///...), got {url}")
    path = os.path.realpath(urllib.request.url2pathname(parsed.path))  # resolves .. and symlinks
    root = os.path.realpath(allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"image_url: the file path {url} (real path {path}) is outside --allowed-local-media-path "
                         f"{root}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FETCH_BYTES + 1)
    except OSError as e:
        raise ValueError(f"image_url: cannot read {url}: {e.strerror or e}") from None
    if len(data) > MAX_FETCH_BYTES:
        raise ValueError(f"image_url: {url} is more than {MAX_FETCH_BYTES} bytes; at most {MAX_FETCH_BYTES} are read")
    return data
