"""Schemas of the pooling endpoints (vLLM's names and shapes): /v1/embeddings (OpenAI's),
/pooling, /classify, /score and /v1/score, /rerank, /v1/rerank and /v2/rerank (Jina's and
Cohere's request shapes)."""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import Field

from jaxlm.pooling_params import PoolingParams
from jaxlm.serve.protocol import OpenAIBaseModel, UsageInfo, random_uuid

# OpenAI's limit on the inputs of one embeddings request; the other endpoints share it.
MAX_POOLING_INPUTS = 2048

# A string, a list of strings, token ids, or a list of token-id lists (OpenAI's `input`; a
# list mixing strings and token lists is none of these: 400).
PoolingInput = Union[str, list[str], list[int], list[list[int]]]


class _PoolingRequestBase(OpenAIBaseModel):
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None

    def to_pooling_params(self, **extra: Any) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, **extra)


class EmbeddingRequest(_PoolingRequestBase):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's extra

    def to_pooling_params(self, **extra: Any) -> PoolingParams:
        return super().to_pooling_params(dimensions=self.dimensions, normalize=self.normalize, **extra)


class PoolingRequest(EmbeddingRequest):
    """/pooling: the model's raw pooled output (vLLM's ``encode``)."""


class _ListResponse(OpenAIBaseModel):
    """What the list-shaped pooling responses share (their ids' prefixes and data differ)."""

    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(_ListResponse):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    data: list[EmbeddingResponseData]


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: Any


class PoolingResponse(_ListResponse):
    id: str = Field(default_factory=lambda: f"pool-{random_uuid()}")
    data: list[PoolingResponseData]


class ClassificationRequest(_PoolingRequestBase):
    input: PoolingInput
    activation: bool | None = None

    def to_pooling_params(self, **extra: Any) -> PoolingParams:
        return super().to_pooling_params(activation=self.activation, **extra)


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse):
    id: str = Field(default_factory=lambda: f"classify-{random_uuid()}")
    data: list[ClassificationData]


class ScoreRequest(_PoolingRequestBase):
    """vLLM's /score: text_1 against text_2, one to many or N to N."""

    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None

    def to_pooling_params(self, **extra: Any) -> PoolingParams:
        return super().to_pooling_params(activation=self.activation, **extra)


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_ListResponse):
    id: str = Field(default_factory=lambda: f"score-{random_uuid()}")
    data: list[ScoreResponseData]


class RerankDocumentIn(OpenAIBaseModel):
    text: str


class RerankRequest(_PoolingRequestBase):
    """Jina's and Cohere's /rerank: documents as strings or {"text": ...} objects; ``top_n``
    (default: all) and ``return_documents`` (default true, as vLLM)."""

    query: str
    documents: list[Union[str, RerankDocumentIn]]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    activation: bool | None = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def to_pooling_params(self, **extra: Any) -> PoolingParams:
        return super().to_pooling_params(activation=self.activation, **extra)


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{random_uuid()}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
