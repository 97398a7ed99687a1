"""PoolingConfig: the pooling runner (embedding, classification and scoring models), vLLM's
``--runner`` / ``--convert`` / ``--task`` / ``--pooler-config``."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlm.config.utils import arg, parse_json_object

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = ("auto", "generate", "embed", "classify", "score", "reward")
POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL")
# --pooler-config keys (vLLM's PoolerConfig fields jaxlm honours).
POOLER_KEYS = ("pooling_type", "normalize", "activation", "dimensions")


@dataclasses.dataclass
class PoolingConfig:
    """The pooling runner: embedding, classification and cross-encoder models."""

    runner: str = arg("auto", "generate (text generation) or pooling (embed, classify, score); auto: pooling for "
                              "*Model, *ForSequenceClassification and sentence-transformers checkpoints",
                      choices=RUNNERS)
    convert: str = arg("auto", "how a pooling runner uses the model: embed (hidden states pooled into vectors) or "
                               "classify (a classification head); auto: from the architecture", choices=CONVERTS)
    task: str = arg("auto", "vLLM's older spelling: generate is --runner generate; embed, classify, score and "
                            "reward are --runner pooling (score/reward: cross-encoders and reward models)",
                    choices=TASKS)
    pooler_config: dict[str, Any] | None = arg(
        None, "override the model's pooler, a JSON object, e.g. '{\"pooling_type\": \"MEAN\", \"normalize\": false}' "
              f"(keys: {', '.join(POOLER_KEYS)}; pooling types {', '.join(POOLING_TYPES)})", parse=parse_json_object)

    def __post_init__(self) -> None:
        for name, choices in (("runner", RUNNERS), ("convert", CONVERTS), ("task", TASKS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"Unknown {name} {getattr(self, name)!r}; choose one of {', '.join(choices)}")
        if self.task == "generate" and self.runner == "pooling" or self.task not in ("auto", "generate") \
                and self.runner == "generate":
            raise ValueError(f"task={self.task!r} contradicts runner={self.runner!r}")
        if self.pooler_config is not None:
            unknown = set(self.pooler_config) - set(POOLER_KEYS)
            if unknown:
                raise ValueError(f"pooler_config: unknown key(s) {', '.join(sorted(unknown))}; "
                                 f"known: {', '.join(POOLER_KEYS)}")
            ptype = self.pooler_config.get("pooling_type")
            if ptype is not None and str(ptype).upper() not in POOLING_TYPES:
                raise ValueError(f"pooler_config: pooling_type {ptype!r}; choose one of {', '.join(POOLING_TYPES)}")

    @property
    def wants_pooling(self) -> bool | None:
        """True/False when the flags decide the runner; None: the architecture decides."""
        if self.runner != "auto":
            return self.runner == "pooling"
        if self.task != "auto":
            return self.task != "generate"
        if self.convert in ("embed", "classify"):
            return True
        return None
