"""Tokenizers: HF fast tokenizers from a model directory or from GGUF metadata."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

from jaxlm.config import ModelConfig, jaxlm_cache_root
from jaxlm.model_loader.errors import NoWeightsError
from jaxlm.model_loader.formats import default_model_path, detect_load_format, find_gguf_file, model_dir
from jaxlm.model_loader.hf_cache import resolve_model_path

logger = logging.getLogger(__name__)


def _gguf_chat_template(gguf_path: str) -> str | None:
    from jaxlm.model_loader.gguf_utils import open_gguf

    return open_gguf(gguf_path).fields.get("tokenizer.chat_template")


def _cache_dir(gguf_path: str) -> str | None:
    """Where the tokenizer converted from a GGUF is kept (converting takes seconds; loading ms)."""
    root = jaxlm_cache_root()
    if root is None:
        return None
    import transformers

    st = os.stat(gguf_path)
    # A new file or a new transformers (its vocab builders may change) gets a new entry.
    ident = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return os.path.join(root, "tokenizers", f"{os.path.basename(gguf_path)}-{key}")


# GGUF metadata key → (group, name) as transformers' GGUF tokenizer builders expect them.
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                        "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def build_gguf_tokenizer_without_torch(gguf_path: str) -> Any:
    """The GGUF's tokenizer built from our own metadata reader.

    ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` goes through transformers' GGUF reader,
    which imports torch; torch is not a runtime dependency of jaxlm. transformers' vocabulary
    builders themselves (``convert_gguf_tokenizer``) do not need it, so feed them directly, the
    way transformers' ``get_gguf_tokenizer`` does.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    from jaxlm.model_loader.gguf_reader import GGUFFile

    meta = GGUFFile(gguf_path, keep_string_arrays=True).fields

    def plain(v: Any) -> Any:
        return v.tolist() if hasattr(v, "tolist") else v

    groups = {
        group: {name: plain(meta[f"tokenizer.{key}"]) for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to sentencepiece vocabs
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**config, **extra})


def _gguf_tokenizer(gguf_path: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    # Only the plain tokenizer is cached: other kwargs may change what is built.
    cache = _cache_dir(gguf_path) if set(kwargs) <= {"local_files_only"} else None
    if cache and os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache, **kwargs)
        except Exception as e:  # a damaged cache entry: rebuild it
            logger.warning("ignoring the cached tokenizer %s: %s", cache, e)
    logger.info("building the tokenizer from GGUF metadata of %s", gguf_path)
    try:
        # Our metadata reader + transformers' vocab builders: torch-free and ~6x faster than
        # AutoTokenizer(gguf_file=...), whose GGUF reader imports torch.
        tok = build_gguf_tokenizer_without_torch(gguf_path)
    except (ImportError, KeyError, ValueError, TypeError) as e:  # transformers' internals moved
        logger.info("direct GGUF tokenizer build failed (%s); using AutoTokenizer(gguf_file=...)", e)
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), **kwargs)
    if not getattr(tok, "chat_template", None):
        template = _gguf_chat_template(gguf_path)
        if template:
            tok.chat_template = template
    if cache:
        tmp = f"{cache}.tmp{os.getpid()}"
        try:
            tok.save_pretrained(tmp)
            os.replace(tmp, cache)  # atomic: concurrent engines never read half a cache entry
        except OSError as e:
            logger.warning("could not cache the tokenizer in %s: %s", cache, e)
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def get_tokenizer(model_config: ModelConfig, **kwargs: Any) -> Any:
    """An HF fast tokenizer for ``model_config.tokenizer`` (or the model path when unset).

    A directory with tokenizer files wins; otherwise a GGUF's embedded vocab is converted by
    transformers (without torch when it is not installed), its chat template taken from the GGUF
    metadata, and the result cached under jaxlm_cache_root()/tokenizers ($JAXLM_CACHE_DIR, "" = off).
    """
    from transformers import AutoTokenizer

    kwargs.setdefault("local_files_only", True)  # never reach for the hub: paths are local
    path = model_config.tokenizer or model_config.model or default_model_path()
    path = resolve_model_path(path, getattr(model_config, "revision", None))
    if not os.path.exists(path):
        raise NoWeightsError(path, "tokenizer path does not exist")
    directory = model_dir(path)
    has_tokenizer_files = any(
        os.path.isfile(os.path.join(directory, n)) for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not path.endswith(".gguf") and has_tokenizer_files:
        return AutoTokenizer.from_pretrained(directory, **kwargs)
    if path.endswith(".gguf") or detect_load_format(path) == "gguf":
        return _gguf_tokenizer(find_gguf_file(path), **kwargs)
    raise NoWeightsError(path, "no tokenizer files (tokenizer.json / tokenizer_config.json) found; "
                               "--skip-tokenizer-init (LLM(skip_tokenizer_init=True)) runs on token ids without one")
