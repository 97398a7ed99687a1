"""Which runner serves a model, which pooling architecture it loads as, and its pooler: from the
flags (``--runner``, ``--convert``, ``--task``, ``--pooler-config``), the HF architecture and a
sentence-transformers ``modules.json`` / ``1_Pooling/config.json`` (vLLM's rules). No jax."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from jaxlm.config.pooling import PoolingConfig

logger = logging.getLogger(__name__)

_ST_MODES = {  # sentence-transformers pooling mode -> pooling type
    "cls": "CLS", "mean": "MEAN", "lasttoken": "LAST",
}
_ST_LEGACY_KEYS = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                   "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED_LEGACY = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                          "pooling_mode_weightedmean_tokens")


def is_pooling_architecture(arch: str) -> bool:
    """vLLM's rule: ``*Model`` (not GPT-2's ``*LMHeadModel``) and ``*ForSequenceClassification``."""
    return arch.endswith(("ForSequenceClassification", "ForRewardModel")) or (
        arch.endswith("Model") and not arch.endswith("LMHeadModel"))


def _archs(hf_config: Any) -> list[str]:
    return list(getattr(hf_config, "architectures", None) or [])


def model_directory(path: str | None) -> str | None:
    if path is None:
        return None
    return path if os.path.isdir(path) else os.path.dirname(path)


def read_sentence_transformers(directory: str | None) -> dict[str, Any] | None:
    """{"pooling_type", "normalize"} from a sentence-transformers checkpoint (None: not one)."""
    if directory is None or not os.path.isfile(os.path.join(directory, "modules.json")):
        return None
    with open(os.path.join(directory, "modules.json"), encoding="utf-8") as f:
        modules = json.load(f)
    out: dict[str, Any] = {"normalize": False, "pooling_type": None}
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            out["normalize"] = True
        elif kind.endswith("Pooling"):
            path = os.path.join(directory, module.get("path", ""), "config.json")
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    out["pooling_type"] = _st_pooling_type(json.load(f), path)
    return out


def _st_pooling_type(cfg: dict[str, Any], path: str) -> str:
    mode = cfg.get("pooling_mode")
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else list(mode)
        if len(modes) != 1 or modes[0] not in _ST_MODES:
            raise ValueError(f"{path}: pooling_mode {mode!r} is not supported (cls, mean or lasttoken)")
        return _ST_MODES[modes[0]]
    on = [t for k, t in _ST_LEGACY_KEYS.items() if cfg.get(k)]
    bad = [k for k in _ST_UNSUPPORTED_LEGACY if cfg.get(k)]
    if bad or len(on) != 1:
        raise ValueError(f"{path}: pooling modes {bad + on} are not supported (exactly one of cls, mean, lasttoken)")
    return on[0]


def use_pooling_runner(pooling: PoolingConfig, hf_config: Any, model_path: str | None) -> bool:
    """True: the pooling runner serves this model. A pooling-only architecture asked to generate
    is refused here, naming the flag."""
    wanted = pooling.wants_pooling
    archs = _archs(hf_config)
    pooling_arch = bool(archs) and all(is_pooling_architecture(a) for a in archs)
    if wanted is None:
        st = read_sentence_transformers(model_directory(model_path)) is not None
        return pooling_arch or st
    if not wanted and pooling_arch:
        raise ValueError(f"{archs[0]} is a pooling model (embeddings, classification, scores), it cannot "
                         "generate text: serve it with --runner pooling (LLM(..., runner=\"pooling\"))")
    return wanted


def pooling_architecture(pooling: PoolingConfig, hf_config: Any) -> str:
    """The architecture the pooling runner loads: a pooling one as it is; a ``*ForCausalLM``
    converted to ``*Model`` (embed) or ``*ForSequenceClassification`` (classify)."""
    archs = _archs(hf_config)
    if not archs:
        raise ValueError("the model's config.json names no architectures")
    arch = archs[0]
    convert = pooling.convert
    if convert == "auto" and pooling.task in ("classify", "score", "reward") and not is_pooling_architecture(arch):
        convert = "classify"
    if is_pooling_architecture(arch) and convert in ("auto", "none"):
        return arch
    base = arch
    for suffix in ("ForCausalLM", "ForSequenceClassification", "Model"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    if convert == "none":
        raise ValueError(f"{arch} has no pooling form without conversion: use --convert embed or classify")
    return base + ("ForSequenceClassification" if convert == "classify" else "Model")


@dataclasses.dataclass(frozen=True)
class PoolerSpec:
    """The model's pooler: fixed for the engine (each compiled program pools this way)."""

    pooling_type: str  # CLS | MEAN | LAST | ALL
    normalize: bool  # embeddings' default
    activation: bool  # classifier outputs' default
    dimensions: int | None  # --pooler-config's default Matryoshka size
    num_labels: int | None  # None: an embedding model (no head)
    hidden_size: int

    @property
    def has_head(self) -> bool:
        return self.num_labels is not None

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        if self.pooling_type == "ALL":
            return ("encode",)
        if self.has_head:
            return ("classify", "score", "reward", "encode") if self.num_labels == 1 else \
                ("classify", "reward", "encode")
        return ("embed", "score", "encode")


def resolve_pooler_spec(pooling: PoolingConfig, hf_config: Any, model_path: str | None, *,
                        default_pooling_type: str, hidden_size: int, num_labels: int | None) -> PoolerSpec:
    """The model's default pooling (the family's, then sentence-transformers', then
    ``--pooler-config``)."""
    pooling_type, normalize = default_pooling_type, True
    st = read_sentence_transformers(model_directory(model_path))
    if st is not None and st["pooling_type"] is not None:
        pooling_type = st["pooling_type"]
    override = dict(pooling.pooler_config or {})
    if "pooling_type" in override:
        pooling_type = str(override["pooling_type"]).upper()
    if "normalize" in override:
        normalize = bool(override["normalize"])
    dims = override.get("dimensions")
    if dims is not None and not (isinstance(dims, int) and 1 <= dims <= hidden_size):
        raise ValueError(f"pooler_config: dimensions {dims!r} must be an integer in 1..{hidden_size}")
    return PoolerSpec(pooling_type=pooling_type, normalize=normalize,
                      activation=bool(override.get("activation", True)), dimensions=dims,
                      num_labels=num_labels, hidden_size=hidden_size)
