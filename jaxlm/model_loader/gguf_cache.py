"""GGUF weights converted once: the dequantized arrays kept under the cache root.

Dequantizing a GGUF file (block formats like Q4_1, unpermuting q/k) is numpy work on every tensor,
~1.5-3 s for SmolLM2-135M on 2 cores, and it is the same work at every start. The first load writes
each array, as iterate_gguf_weights yields it, into one raw file beside an index; later loads
memory-map that file and yield views of it (no dequantizing, and the pages come from the OS cache).
An entry is keyed by the GGUF file (path, size, mtime) and the source of the code that converts
it, so a new file or a changed converter gets a new entry. JAXLM_CACHE_DIR="" turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator

import numpy as np

from jaxlm.config import jaxlm_cache_root

logger = logging.getLogger(__name__)

_ALIGN = 64  # every array starts on a cache-line boundary of the file (and of its mapping)
# The modules whose code decides the arrays (a change to them invalidates every entry).
_CONVERTER_SOURCES = ("gguf_utils.py", "gguf_reader.py", "gguf_moe.py", "gguf_cache.py")


def _entry_dir(gguf_path: str) -> str | None:
    root = jaxlm_cache_root()
    if root is None:
        return None
    st = os.stat(gguf_path)
    h = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _CONVERTER_SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return os.path.join(root, "gguf-weights", f"{os.path.basename(gguf_path)}-{h.hexdigest()[:16]}")


def _read_entry(entry: str) -> Iterator[tuple[str, np.ndarray]]:
    with open(os.path.join(entry, "index.json"), encoding="utf-8") as f:
        index = json.load(f)
    data = np.memmap(os.path.join(entry, "weights.bin"), dtype=np.uint8, mode="r")
    for name, dtype, shape, offset in index:
        count = int(np.prod(shape, dtype=np.int64))
        yield name, np.frombuffer(data, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)


def _write_through(arrays: Iterator[tuple[str, np.ndarray]], entry: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `arrays` unchanged while writing them to a new entry, published only when complete
    (a write error, e.g. a full disk, only drops the entry: the load goes on)."""
    tmp = f"{entry}.tmp{os.getpid()}"
    index: list[tuple[str, str, list[int], int]] = []
    offset = 0
    out = None
    try:
        os.makedirs(tmp, exist_ok=True)
        out = open(os.path.join(tmp, "weights.bin"), "wb")  # noqa: SIM115 - closed below, also on errors
    except OSError as e:
        logger.warning("cannot cache converted GGUF weights in %s: %s", tmp, e)
    try:
        for name, arr in arrays:
            if out is not None:
                try:
                    data = np.ascontiguousarray(arr)
                    pad = -offset % _ALIGN
                    out.write(b"\0" * pad + data.tobytes())
                    index.append((name, data.dtype.str, list(data.shape), offset + pad))
                    offset += pad + data.nbytes
                except OSError as e:
                    logger.warning("cannot cache converted GGUF weights in %s: %s", tmp, e)
                    out.close()
                    out = None
            yield name, arr
        if out is not None:  # every array converted and written: publish (the converter's errors propagate)
            try:
                out.close()
                with open(os.path.join(tmp, "index.json"), "w", encoding="utf-8") as f:
                    json.dump(index, f)
                os.replace(tmp, entry)  # atomic: a reader never sees half an entry
                logger.info("converted GGUF weights cached in %s (%.0f MiB)", entry, offset / 2**20)
            except OSError as e:  # another process published the entry first, or the index write failed
                logger.info("converted GGUF weights not cached in %s: %s", entry, e)
    finally:
        if out is not None and not out.closed:
            out.close()
        shutil.rmtree(tmp, ignore_errors=True)


def cached_gguf_weights(gguf_path: str,
                        convert: Callable[[], Iterator[tuple[str, np.ndarray]]]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) per tensor: from the converted-weights cache when it holds this file,
    else from convert() (dequantizing), written to the cache on the way."""
    try:
        entry = _entry_dir(gguf_path)
    except OSError:
        entry = None
    if entry is None:
        return convert()
    if os.path.isfile(os.path.join(entry, "index.json")):
        try:
            arrays = list(_read_entry(entry))  # views of one mapping: no tensor data read yet
            logger.info("GGUF weights from the converted-weights cache %s", entry)
            return iter(arrays)
        except (OSError, ValueError, TypeError) as e:  # a damaged entry: convert again
            logger.warning("ignoring the converted-weights cache %s: %s", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
    except OSError as e:
        logger.warning("cannot cache converted GGUF weights under %s: %s", os.path.dirname(entry), e)
        return convert()
    return _write_through(convert(), entry)
