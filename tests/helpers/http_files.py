"""A local http.server for image URLs in tests: fixed bodies by path, anything else 404."""

from __future__ import annotations

import contextlib
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any


def png_bytes(image: Any) -> bytes:
    """A PIL image as PNG file bytes."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@contextlib.contextmanager
def serve_files(bodies: dict[str, tuple[bytes, str]]) -> Iterator[str]:
    """bodies: path -> (body, Content-Type). Yields the base URL (http://127.0.0.1:PORT)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body, kind = bodies.get(self.path, (None, None))
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
