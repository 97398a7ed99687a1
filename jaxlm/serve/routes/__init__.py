"""The server's routes, one router per concern: probes and model list, generation, tokenization."""

from jaxlm.serve.routes.generate import router as generate_router
from jaxlm.serve.routes.info import router as info_router
from jaxlm.serve.routes.tokenize import router as tokenize_router

ROUTERS = (info_router, generate_router, tokenize_router)

__all__ = ["ROUTERS"]
