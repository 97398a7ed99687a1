"""LLM's pooling methods (vLLM's names and output shapes): embed, encode, classify, score,
reward, over a PoolingEngine (``LLM(model, runner="pooling")``, or a pooling architecture)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxlm.entrypoints.score_utils import cosine_scores, pair_inputs
from jaxlm.outputs_pooling import (
    ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringRequestOutput)
from jaxlm.pooling_params import PoolingParams


def _as_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class PoolingMethods:
    """Mixed into LLM: ``self.llm_engine`` is a PoolingEngine for these, an LLMEngine otherwise."""

    llm_engine: Any

    def _pooling(self, what: str) -> Any:
        from jaxlm.engine.pooling_engine import PoolingEngine

        if not isinstance(self.llm_engine, PoolingEngine):
            raise ValueError(f"LLM.{what}() needs a pooling model; this LLM generates text "
                             "(pass runner=\"pooling\" for an embedding or classification model)")
        return self.llm_engine

    def _require_generate(self, what: str) -> None:
        from jaxlm.engine.pooling_engine import PoolingEngine

        if isinstance(self.llm_engine, PoolingEngine):
            raise ValueError(f"LLM.{what}() generates text, and this LLM runs a pooling model "
                             f"(tasks: {', '.join(self.llm_engine.supported_tasks)}): use embed(), classify(), "
                             "score() or encode()")

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, pooling_task: str = "encode") -> list[PoolingRequestOutput]:
        """The pooled output of each prompt (``outputs.data``), in input order."""
        return self._pooling("encode").encode(_as_list(prompts), pooling_params, pooling_task)

    def embed(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``)."""
        params = _with_truncation(pooling_params, truncate_prompt_tokens)
        outs = self._pooling("embed").encode(_as_list(prompts), params, "embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``outputs.probs``)."""
        outs = self._pooling("classify").encode(_as_list(prompts), pooling_params, "classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(self, prompts: Any, pooling_params: PoolingParams | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The reward (classifier) head's raw output for each prompt's last token."""
        return self._pooling("reward").encode(_as_list(prompts), pooling_params, "reward")

    def score(self, data_1: Any, data_2: Any, use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """A score per (data_1, data_2) pair, 1 x N or N x N: a cross-encoder runs each pair
        in one forward; an embedding model scores the cosine of the two embeddings."""
        engine = self._pooling("score")
        pairs = pair_inputs(data_1, data_2)
        params = _with_truncation(pooling_params, truncate_prompt_tokens) or PoolingParams()
        return score_pairs(engine, pairs, params)


def score_pairs(engine: Any, pairs: list[tuple[Any, Any]], params: PoolingParams,
                request_ids: Sequence[str] | None = None) -> list[ScoringRequestOutput]:
    if engine.spec.has_head:
        outs = engine.encode(pairs, params, "score")
        return [ScoringRequestOutput.from_base(o) for o in outs]
    engine.check_task("score")
    flat = [t for pair in pairs for t in pair]
    # Each distinct text embedded once (a query against N documents: once, not N times).
    keys = [t if isinstance(t, str) else i for i, t in enumerate(flat)]
    first_of = {k: i for i, k in reversed(list(enumerate(keys)))}
    unique = sorted(set(first_of.values()))
    embeds = dict(zip(unique, engine.encode([flat[i] for i in unique], params, "embed")))
    outs = [embeds[first_of[k]] for k in keys]
    firsts, seconds = outs[0::2], outs[1::2]
    scores = cosine_scores([e.outputs.data for e in firsts], [e.outputs.data for e in seconds])
    return [ScoringRequestOutput.from_base(PoolingRequestOutput(
        str(i), PoolingOutput(np.asarray([s], np.float32)), a.prompt_token_ids + b.prompt_token_ids))
        for i, (a, b, s) in enumerate(zip(firsts, seconds, scores))]


def _with_truncation(params: Any, truncate: int | None) -> Any:
    if truncate is None:
        return params
    base = params if isinstance(params, PoolingParams) else PoolingParams()
    out = base.clone()
    out.truncate_prompt_tokens = truncate
    return out
