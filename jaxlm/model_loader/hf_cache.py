"""Models by name (``org/name``) from the local Hugging Face cache, offline.

jaxlm never downloads: a name that is not a local path is looked up in the hub cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) with
``local_files_only=True``, and a name that is not there gets an error saying how to get it.
"""

from __future__ import annotations

import logging
import os
import re

from jaxlm.model_loader.errors import NoWeightsError

logger = logging.getLogger(__name__)

# "org/name" or a legacy un-namespaced "name", as the hub spells repo ids.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def hf_hub_cache_dir() -> str:
    """The hub cache directory huggingface_hub would use, read from the environment now
    (huggingface_hub.constants freezes it at import time)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return os.path.expanduser(cache)
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def looks_like_repo_id(model: str) -> bool:
    """A string that is no local path but could name a hub repository."""
    return (
        not os.path.exists(os.path.expanduser(model))
        and bool(_REPO_ID.match(model))
        and not model.endswith((".gguf", ".safetensors"))
    )


def find_in_hf_cache(repo_id: str, revision: str | None = None) -> str:
    """The snapshot directory of ``repo_id`` (at ``revision``, default main) in the local cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hf_hub_cache_dir()
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as e:
        at = f" at revision {revision!r}" if revision else ""
        raise NoWeightsError(
            repo_id,
            f"not found{at} in the local Hugging Face cache (HF_HUB_CACHE={cache}); jaxlm never downloads: "
            f"run `huggingface-cli download {repo_id}` on a machine with network, or pass a local path",
        ) from e
    logger.info("model %s found in the Hugging Face cache: %s", repo_id, path)
    return str(path)


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """A local path for ``model``: itself (``~`` expanded) or its snapshot in the hub cache."""
    if looks_like_repo_id(model):
        return find_in_hf_cache(model, revision)
    return os.path.expanduser(model)
