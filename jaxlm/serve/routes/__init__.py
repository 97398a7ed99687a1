"""The server's routes, one router per concern: probes and model list, generation, tokenization,
pooling (embeddings, classification, scores, rerank)."""

from jaxlm.serve.routes.generate import router as generate_router
from jaxlm.serve.routes.info import router as info_router
from jaxlm.serve.routes.pooling import router as pooling_router
from jaxlm.serve.routes.tokenize import router as tokenize_router

ROUTERS = (info_router, generate_router, tokenize_router, pooling_router)

__all__ = ["ROUTERS"]
