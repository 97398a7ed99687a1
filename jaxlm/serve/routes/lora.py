"""Run-time LoRA adapters (vLLM's routes; only when VLLM_ALLOW_RUNTIME_LORA_UPDATING or
JAXLM_ALLOW_RUNTIME_LORA_UPDATING is true): POST /v1/load_lora_adapter {"lora_name", "lora_path"}
and POST /v1/unload_lora_adapter {"lora_name"}. The API key guards them like every route."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol import OpenAIBaseModel

router = APIRouter()


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: object = None
    lora_path: object = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: object = None
    lora_int_id: object = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw: Request) -> Response:
    if not raw.app.state.engine.engine_config.lora_config.enable_lora:
        raise OpenAIError("LoRA adapters are not enabled: start the server with --enable-lora", 400)
    await raw.app.state.models.load_lora_adapter(request.lora_name, request.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw: Request) -> Response:
    await raw.app.state.models.unload_lora_adapter(request.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
