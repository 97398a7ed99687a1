"""/health, /version, /metrics (probes) and /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import jaxlm
from jaxlm.serve.errors import error_json
from jaxlm.serve.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/health")
async def health(raw: Request) -> Response:
    if not raw.app.state.engine.is_running:
        return error_json("engine is not running", 503)
    return Response(status_code=200)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": jaxlm.__version__})


@router.get("/metrics")
async def metrics(raw: Request) -> PlainTextResponse:
    state = raw.app.state
    return PlainTextResponse(state.metrics.render(state.engine.get_stats()),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(raw: Request) -> JSONResponse:
    state = raw.app.state
    cards = [ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)
             for name in state.served_model_names]
    return JSONResponse(ModelList(data=cards).model_dump())
