"""The pooling runner's request outputs, with vLLM's names and shapes.

``PoolingRequestOutput`` carries the raw pooled tensor (``outputs.data``); ``LLM.embed``,
``classify`` and ``score`` wrap it as ``EmbeddingRequestOutput`` (``outputs.embedding``),
``ClassificationRequestOutput`` (``outputs.probs``) and ``ScoringRequestOutput``
(``outputs.score``), as vLLM's ``vllm/outputs.py`` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `import jaxlm` stays free of numpy (tests/structured_output: the params are light)
    import numpy as np


@dataclasses.dataclass
class PoolingOutput:
    """The pooled tensor: [hidden] (or [dimensions]) for CLS/MEAN/LAST, [tokens, hidden] for ALL,
    [num_labels] for a classifier head."""

    data: np.ndarray


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    @classmethod
    def from_base(cls, out: PoolingOutput) -> "EmbeddingOutput":
        if out.data.ndim != 1:
            raise ValueError(f"an embedding is one vector; got shape {out.data.shape} (pooling type ALL?)")
        return cls(embedding=out.data.tolist())


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @classmethod
    def from_base(cls, out: PoolingOutput) -> "ClassificationOutput":
        import numpy as np

        return cls(probs=np.asarray(out.data).reshape(-1).tolist())


@dataclasses.dataclass
class ScoringOutput:
    score: float

    @classmethod
    def from_base(cls, out: PoolingOutput) -> "ScoringOutput":
        import numpy as np

        data = np.asarray(out.data).reshape(-1)
        if data.size != 1:
            raise ValueError(f"a score is one number; the model gave {data.size} (a classifier of several labels)")
        return cls(score=float(data[0]))


O = TypeVar("O")


@dataclasses.dataclass
class PoolingRequestOutput(Generic[O]):
    """One request's result: its id, prompt token ids and pooled output."""

    request_id: str
    outputs: O
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, r: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(r.request_id, EmbeddingOutput.from_base(r.outputs), r.prompt_token_ids, r.finished)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, r: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(r.request_id, ClassificationOutput.from_base(r.outputs), r.prompt_token_ids, r.finished)


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_base(cls, r: PoolingRequestOutput) -> "ScoringRequestOutput":
        return cls(r.request_id, ScoringOutput.from_base(r.outputs), r.prompt_token_ids, r.finished)


def as_plain(value: Any) -> Any:
    """numpy → lists/floats (JSON)."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (int, float)) else value
