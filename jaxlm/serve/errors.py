"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} for every failure."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxlm.engine.exceptions import EngineDeadError, EngineGenerateError, QueueFullError
from jaxlm.engine.input_processor import InvalidRequestError
from jaxlm.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# Status -> OpenAI error type (the names vLLM and OpenAI's SDK use).
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """Raised anywhere in a handler; rendered as an OpenAI error body with this status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_response(message: str, status: int, param: str | None = None) -> ErrorResponse:
    err_type = _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))


def error_json(message: str, status: int, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = error_response(message, status, param)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Maps engine-side exceptions to the HTTP status a client should see."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, QueueFullError):
        return OpenAIError(str(exc), 429)
    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), 503)
    if isinstance(exc, EngineGenerateError):  # this request alone failed; logged by the engine
        return OpenAIError(str(exc), 500)
    if isinstance(exc, (ValueError, TypeError, OverflowError)):  # InvalidRequestError names its field
        return OpenAIError(str(exc), 400, getattr(exc, "param", None))
    logger.exception("internal error", exc_info=exc)
    return OpenAIError(f"internal server error: {type(exc).__name__}", 500)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc and param is None:
            param = ".".join(loc)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # 400 rather than FastAPI's 422, like vLLM and OpenAI.
        message, param = _validation_message(exc)
        return error_json(message, 400, param)

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_json(exc.message, exc.status, exc.param)

    @app.exception_handler(InvalidRequestError)  # e.g. a message chat_utils cannot read: a 400
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_json(str(exc), 400, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        err = to_openai_error(exc)
        return error_json(err.message, err.status, err.param)
