"""Plain-ASGI middleware (not BaseHTTPMiddleware, so streamed responses and disconnect events
pass through untouched): the API key check and the request-body size limit."""

from __future__ import annotations

import asyncio
import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxlm.serve.errors import error_json

# Routes a load balancer or scraper polls; open unless --guard-probes.
PROBE_PATHS = frozenset({"/health", "/version", "/metrics"})


def route_path(scope: Scope) -> str:
    """The path inside the app (without --root-path, however the proxy passed it)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def bearer_token(headers: Headers) -> bytes | None:
    """The token of 'Authorization: Bearer TOKEN' (the scheme is case-insensitive, RFC 6750)."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()


class AuthenticationMiddleware:
    """Bearer-token check on every route but the probes (/health, /version, /metrics), and on
    those too with guard_probes; CORS preflights (OPTIONS) pass."""

    def __init__(self, app: ASGIApp, api_keys: list[str], guard_probes: bool = False) -> None:
        self.app = app
        self.keys = [key.encode() for key in api_keys]
        self.guard_probes = guard_probes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and self._guarded(route_path(scope)):
            token = bearer_token(Headers(scope=scope)) or b""
            # Every key compared, each in constant time: the answer's timing tells nothing.
            if not any([hmac.compare_digest(token, key) for key in self.keys]):
                await error_json("Unauthorized: missing or invalid API key", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _guarded(self, path: str) -> bool:
        return self.guard_probes or path not in PROBE_PATHS


class _BodyTooLarge(HTTPException):
    # An HTTPException: FastAPI re-raises those from its body parsing (others become a 400).
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is larger than {max_bytes} bytes (--max-request-body-bytes)",
                         headers={"connection": "close"})


class _BodyTimeout(HTTPException):
    def __init__(self, seconds: float | None) -> None:
        super().__init__(408, f"the request body stalled for more than {seconds} s", headers={"connection": "close"})


class BodyLimitMiddleware:
    """413 for a body past max_bytes: at once from Content-Length, else while it streams in
    (chunked bodies); 408 when the client stalls more than idle_timeout_s between body chunks."""

    def __init__(self, app: ASGIApp, max_bytes: int, idle_timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        seen = 0
        body_done = started = False

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if body_done:  # e.g. the disconnect watcher: no limit on how long a response takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout_s)
            except asyncio.TimeoutError:
                raise _BodyTimeout(self.idle_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except (_BodyTooLarge, _BodyTimeout) as e:
            if started:  # too late for a status: the connection just ends
                raise
            await error_json(e.detail, e.status_code, headers=e.headers)(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        e = _BodyTooLarge(self.max_bytes)
        await error_json(e.detail, e.status_code, headers=e.headers)(scope, receive, send)
