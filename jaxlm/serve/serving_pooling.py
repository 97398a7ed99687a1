"""The pooling endpoints' work (vLLM's OpenAIServingEmbedding / Pooling / Classification /
Score, in one class): inputs -> the pooling engine -> vLLM's response shapes, usage filled in,
each request counted in /metrics."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np

from jaxlm.entrypoints.score_utils import cosine_scores, pair_inputs
from jaxlm.serve.errors import OpenAIError
from jaxlm.serve.protocol import UsageInfo
from jaxlm.serve.protocol_pooling import (
    MAX_POOLING_INPUTS, ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingRequest,
    EmbeddingResponse, EmbeddingResponseData, PoolingRequest, PoolingResponse, PoolingResponseData, RerankDocument,
    RerankRequest, RerankResponse, RerankResult, RerankUsage, ScoreRequest, ScoreResponse, ScoreResponseData)
from jaxlm.serve.serving_engine import OpenAIServing


def normalize_input(value: Any, param: str = "input") -> list[Any]:
    """OpenAI's ``input``: a string, token ids, or a list of either -> a list of prompts."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(x, int) for x in value):
        items = [value]
    else:
        items = list(value)
    if not items or any(isinstance(x, (str, list)) and len(x) == 0 for x in items):
        raise OpenAIError(f"{param} is empty (an empty string or token list)", 400, param)
    if len(items) > MAX_POOLING_INPUTS:
        raise OpenAIError(f"{len(items)} inputs in one request; at most {MAX_POOLING_INPUTS}", 400, param)
    return items


def _encoded(data: Any, encoding_format: str) -> Any:
    """float: nested lists; base64: the float32 bytes (little-endian), as OpenAI's API."""
    arr = np.asarray(data, np.float32)
    return base64.b64encode(arr.tobytes()).decode("ascii") if encoding_format == "base64" else arr.tolist()


class OpenAIServingPooling:
    def __init__(self, engine: Any, models: Any, metrics: Any):
        self.engine = engine  # an AsyncPoolingEngine
        self.models = models
        self.metrics = metrics

    def _run_checks(self, model: str | None) -> str:
        if not self.engine.is_running:
            raise OpenAIError("the engine is not running", 503)
        return self.models.check_model(model)

    async def _encode(self, prompts: list[Any], params: Any, task: str) -> list[Any]:
        start = time.monotonic()
        outs = await self.engine.encode(prompts, params, task)
        elapsed = time.monotonic() - start
        series = self.metrics.engine(0)
        series.success["stop"].inc(len(outs))
        for o in outs:
            series.e2e.observe(elapsed)
            series.prompt_tokens.observe(len(o.prompt_token_ids))
        return outs

    @staticmethod
    def _usage(outs: list[Any]) -> UsageInfo:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return UsageInfo(prompt_tokens=n, total_tokens=n)

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Any = None) -> EmbeddingResponse:
        model = self._run_checks(request.model)
        request_id = f"embd-{OpenAIServing._base_request_id(raw_request)}"
        outs = await self._encode(normalize_input(request.input), request.to_pooling_params(), "embed")
        data = [EmbeddingResponseData(index=i, embedding=_encoded(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outs)]
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=self._usage(outs))

    async def create_pooling(self, request: PoolingRequest, raw_request: Any = None) -> PoolingResponse:
        model = self._run_checks(request.model)
        request_id = f"pool-{OpenAIServing._base_request_id(raw_request)}"
        outs = await self._encode(normalize_input(request.input), request.to_pooling_params(), "encode")
        data = [PoolingResponseData(index=i, data=_encoded(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outs)]
        return PoolingResponse(id=request_id, model=model, data=data, usage=self._usage(outs))

    async def create_classify(self, request: ClassificationRequest, raw_request: Any = None) -> ClassificationResponse:
        model = self._run_checks(request.model)
        request_id = f"classify-{OpenAIServing._base_request_id(raw_request)}"
        outs = await self._encode(normalize_input(request.input), request.to_pooling_params(), "classify")
        labels = getattr(self.engine.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = np.asarray(o.outputs.data, np.float32).reshape(-1)
            label = labels.get(int(np.argmax(probs)))
            data.append(ClassificationData(index=i, label=label, probs=probs.tolist(), num_classes=len(probs)))
        return ClassificationResponse(id=request_id, model=model, data=data, usage=self._usage(outs))

    async def _score_pairs(self, left: Any, right: Any, params: Any) -> tuple[list[float], list[Any]]:
        try:
            pairs = pair_inputs(left, right)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "text_1") from e
        if len(pairs) > MAX_POOLING_INPUTS:
            raise OpenAIError(f"{len(pairs)} pairs in one request; at most {MAX_POOLING_INPUTS}", 400, "text_2")
        if any(not a or not b for a, b in pairs):
            raise OpenAIError("a text to score is empty", 400, "text_2")
        engine = self.engine.engine
        if engine.spec.has_head:
            outs = await self._encode(pairs, params, "score")
            return [float(np.asarray(o.outputs.data).reshape(-1)[0]) for o in outs], outs
        engine.check_task("score")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text once
        outs = await self._encode(texts, params, "embed")
        vec = {t: o.outputs.data for t, o in zip(texts, outs)}
        return cosine_scores([vec[a] for a, _ in pairs], [vec[b] for _, b in pairs]), outs

    async def create_score(self, request: ScoreRequest, raw_request: Any = None) -> ScoreResponse:
        model = self._run_checks(request.model)
        request_id = f"score-{OpenAIServing._base_request_id(raw_request)}"
        scores, outs = await self._score_pairs(request.text_1, request.text_2, request.to_pooling_params())
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(id=request_id, model=model, data=data, usage=self._usage(outs))

    async def create_rerank(self, request: RerankRequest, raw_request: Any = None) -> RerankResponse:
        model = self._run_checks(request.model)
        request_id = f"rerank-{OpenAIServing._base_request_id(raw_request)}"
        docs = request.document_texts()
        if not docs:
            raise OpenAIError("documents is empty", 400, "documents")
        if not request.query:
            raise OpenAIError("query is empty", 400, "query")
        scores, outs = await self._score_pairs(request.query, docs, request.to_pooling_params())
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        top_n = request.top_n or len(docs)
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i]) if request.return_documents else None)
                   for i in order[:top_n]]
        return RerankResponse(id=request_id, model=model, usage=RerankUsage(total_tokens=self._usage(outs).total_tokens),
                              results=results)


class GenerationRefused:
    """A pooling server's stand-in for the completion and chat handlers: every call is a 400."""

    def __init__(self, tasks: tuple[str, ...]):
        self.tasks = tasks

    def __getattr__(self, name: str) -> Any:
        def refuse(*_: Any, **__: Any) -> Any:
            raise OpenAIError("this model is a pooling model (tasks: " + ", ".join(self.tasks) + "): it does not "
                              "generate text; use /v1/embeddings, /pooling, /classify, /score or /rerank", 400)

        return refuse
