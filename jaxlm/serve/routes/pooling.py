"""The pooling endpoints: /v1/embeddings, /pooling, /classify, /score and /v1/score, /rerank,
/v1/rerank and /v2/rerank. A server that generates text answers them with a 400 naming
--runner pooling (and a pooling server answers the generation endpoints the same way)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol_pooling import (
    ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest)
from jaxlm.serve.routes.generate import respond, until_disconnected
from jaxlm.serve.serving_pooling import OpenAIServingPooling

router = APIRouter()


def _serving(raw: Request, endpoint: str) -> OpenAIServingPooling:
    serving = getattr(raw.app.state, "serving_pooling", None)
    if serving is None:
        raise OpenAIError(f"{endpoint} needs a pooling model (embedding, classification or cross-encoder); this "
                          "server generates text (serve such a model with --runner pooling)", 400)
    return serving


@router.post("/v1/embeddings")
async def embeddings(request: EmbeddingRequest, raw: Request) -> Response:
    serving = _serving(raw, "/v1/embeddings")
    return respond(await until_disconnected(raw, serving.create_embedding(request, raw)))


@router.post("/pooling")
async def pooling(request: PoolingRequest, raw: Request) -> Response:
    serving = _serving(raw, "/pooling")
    return respond(await until_disconnected(raw, serving.create_pooling(request, raw)))


@router.post("/classify")
async def classify(request: ClassificationRequest, raw: Request) -> Response:
    serving = _serving(raw, "/classify")
    return respond(await until_disconnected(raw, serving.create_classify(request, raw)))


@router.post("/score")
@router.post("/v1/score")
async def score(request: ScoreRequest, raw: Request) -> Response:
    serving = _serving(raw, "/score")
    return respond(await until_disconnected(raw, serving.create_score(request, raw)))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: RerankRequest, raw: Request) -> Response:
    serving = _serving(raw, "/rerank")
    return respond(await until_disconnected(raw, serving.create_rerank(request, raw)))
