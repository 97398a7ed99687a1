"""PoolingParams: what a pooling request asks of the pooler (vLLM's names and meanings)."""

from __future__ import annotations

import dataclasses
from typing import Any

# vLLM's pooling tasks: what LLM.embed / classify / score / encode / reward ask the model for.
POOLING_TASKS = ("embed", "classify", "score", "encode", "reward")


@dataclasses.dataclass
class PoolingParams:
    """Per-request pooling options.

    ``dimensions``: Matryoshka truncation of an embedding (refused past the model's size).
    ``normalize``: L2-normalize the embedding (None: the model's default, normally True).
    ``activation``: apply the classifier head's activation (sigmoid for one label, softmax for
    several; None: True). ``truncate_prompt_tokens``: keep only the last k prompt tokens
    (-1: as many as ``max_model_len`` allows; None: refuse a prompt that does not fit).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1, got 0")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task {self.task!r}; choose one of {', '.join(POOLING_TASKS)}")

    def clone(self) -> "PoolingParams":
        return dataclasses.replace(self)

    def with_task(self, task: str) -> "PoolingParams":
        return dataclasses.replace(self, task=task)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
