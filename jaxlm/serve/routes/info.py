"""/health, /version, /metrics (probes) and /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import jaxlm
from jaxlm.serve.errors import error_json
from jaxlm.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from jaxlm.serve.protocol import ModelList

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
async def metrics(raw: Request) -> Response:
    return Response(raw.app.state.metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/tokenizer_info")
async def tokenizer_info(raw: Request) -> JSONResponse:
    # Opt-in, as vLLM (it shows the chat template): --enable-tokenizer-info-endpoint.
    if not raw.app.state.enable_tokenizer_info_endpoint:
        return error_json("Not Found", 404)
    return JSONResponse(raw.app.state.serving_completion.tokenizer_info())


@router.get("/v1/models")
async def models(raw: Request) -> JSONResponse:
    # The base model's names, then each LoRA adapter with parent = its base model.
    return JSONResponse(ModelList(data=raw.app.state.models.model_cards()).model_dump())
