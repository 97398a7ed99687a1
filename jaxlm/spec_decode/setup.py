"""Engine start with a speculative_config: its limits against the engine's, and the draft model's
config (resolved like the target's) with its tokenizer checked against the target's."""

from __future__ import annotations

import logging
from typing import Any

from jaxlm.config import EngineConfig, LoadConfig, ModelConfig

logger = logging.getLogger(__name__)


def resolve_speculative_config(config: EngineConfig, tokenizer: Any) -> None:
    """Check the speculative config against the resolved engine config; for a draft model,
    resolve its ModelConfig (SpeculativeConfig.draft_model_config). Raises ValueError naming
    the problem (a draft with another tokenizer or vocabulary names both models)."""
    spec = config.speculative_config
    if spec is None:
        return
    parallel, sched = config.parallel_config, config.scheduler_config
    for name in ("pipeline_parallel_size", "nnodes"):
        if getattr(parallel, name) > 1:
            raise ValueError(f"speculative decoding with {name}={getattr(parallel, name)} is not supported yet")
    spec.check_against(sched.max_num_batched_tokens, sched.max_model_len, parallel.tensor_parallel_size)
    if not spec.uses_draft_model:
        logger.info("speculative decoding: ngram, %d tokens, lookup %d-%d", spec.num_speculative_tokens,
                    spec.prompt_lookup_min, spec.prompt_lookup_max)
        return
    from jaxlm.model_loader import get_tokenizer, resolve_model_config

    target = config.model_config
    draft = ModelConfig(model=spec.model, revision=spec.revision, dtype=target.dtype,
                        max_model_len=target.max_model_len, seed=target.seed)
    draft = resolve_model_config(draft, LoadConfig())  # its own format, whatever the target's
    target_vocab, draft_vocab = int(target.hf_config.vocab_size), int(draft.hf_config.vocab_size)
    # skip_tokenizer_init: no tokenizer to compare, only the vocabularies' sizes.
    draft_tokens = get_tokenizer(draft).get_vocab() if tokenizer is not None else {}
    target_tokens = tokenizer.get_vocab() if tokenizer is not None else {}
    if draft_vocab != target_vocab or draft_tokens != target_tokens:
        raise ValueError(
            f"The draft model {spec.model!r} (vocabulary {draft_vocab}, tokenizer of {len(draft_tokens)} tokens) "
            f"and the target model {target.model!r} (vocabulary {target_vocab}, tokenizer of "
            f"{len(target_tokens)} tokens) do not share a tokenizer: speculative decoding needs the "
            "draft to propose the target's token ids")
    spec.draft_model_config = draft
    logger.info("speculative decoding: draft model %s, %d tokens", spec.model, spec.num_speculative_tokens)


def build_spec_runner(config: EngineConfig, model: Any, mesh: Any, attn_backend: Any) -> Any:
    """The SpecModelRunner of an engine with a speculative_config, its draft model loaded onto
    the target's mesh (draft_tensor_parallel_size 1 under a TP target: onto the first device)."""
    from jaxlm.spec_decode.runner import SpecModelRunner

    spec = config.speculative_config
    if not spec.uses_draft_model:
        return SpecModelRunner(config, model, mesh)
    import jax
    import numpy as np

    from jaxlm.attention.backends import get_attention_backend
    from jaxlm.attention.sharded import shard_attention_backend
    from jaxlm.model_loader import get_model

    draft_mesh = mesh
    if draft_tp(config) != config.parallel_config.tensor_parallel_size:
        draft_mesh = jax.sharding.Mesh(np.array(mesh.devices.flat[:1]).reshape(1, 1), ("data", "model"))
        attn_backend = shard_attention_backend(
            get_attention_backend(config.attention_backend, kv_quant=attn_backend.kv_quant), draft_mesh)
    draft = get_model(spec.draft_model_config, LoadConfig(), attn_backend=attn_backend, mesh=draft_mesh)
    return SpecModelRunner(config, model, mesh, draft, draft_mesh)


def draft_tp(config: EngineConfig) -> int:
    """The draft model's tensor-parallel size (default: the target's)."""
    spec = config.speculative_config
    return spec.draft_tensor_parallel_size or config.parallel_config.tensor_parallel_size
