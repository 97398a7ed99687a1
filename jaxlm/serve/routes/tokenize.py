"""/tokenize and /detokenize: the tokenizer's work runs on a worker thread, never on the event loop."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from jaxlm.serve.chat_template import render_chat_request
from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from jaxlm.serve.serving_chat import OpenAIServingChat

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw: Request) -> JSONResponse:
    chat: OpenAIServingChat = raw.app.state.serving_chat
    chat.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("give exactly one of prompt and messages", 400)
    if request.messages is not None:
        ids = (await render_chat_request(chat, request)).prompt_token_ids
    else:
        ids = await asyncio.to_thread(chat.encode, request.prompt, request.add_special_tokens)
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=chat.max_model_len, tokens=ids).model_dump())


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw: Request) -> JSONResponse:
    chat: OpenAIServingChat = raw.app.state.serving_chat
    chat.check_model(request.model)
    chat.check_token_ids(request.tokens)
    chat.require_tokenizer("tokens", "/detokenize")
    text = await asyncio.to_thread(chat.tokenizer.decode, request.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
