"""Safetensors checkpoints through the ``safetensors`` package, tensor by tensor, every failure named.

``safe_open(framework="numpy")`` validates the header against the file size when the file is
opened (a truncated download fails before anything is placed) and reads bf16 through ml_dtypes.
Its errors are re-raised as load errors naming the file (and the tensor, where there is one).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import ml_dtypes  # also registers numpy's "bfloat16", which safetensors' numpy reader asks for
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxlm.model_loader.errors import CorruptCheckpointError, NoWeightsError, UnsupportedDtypeError
from jaxlm.model_loader.formats import SAFETENSORS_INDEX

# Safetensors dtypes read as numpy arrays.
_NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
# fp8 (quantized checkpoints' weights): safetensors' numpy reader has no float8 type, so these
# are read from the file's bytes (ml_dtypes' types), by the header's offsets.
_RAW_DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_HEADER_ERROR_PREFIX = "Error while deserializing header: "


def list_safetensors_files(path: str) -> list[str]:
    """The shard files of a checkpoint: the index's files if there is one, else every *.safetensors."""
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(index, f"bad index file ({e})") from e
        files = [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise CorruptCheckpointError(index, f"shard(s) listed but absent: {', '.join(map(os.path.basename, missing))}")
        return files
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise NoWeightsError(path, "no *.safetensors files found")
    return files


def _explain(path: str, err: SafetensorError) -> str:
    why = str(err).removeprefix(_HEADER_ERROR_PREFIX)
    if "not fully covered" in why:
        return f"the file's {os.path.getsize(path)} bytes do not match what its header describes (truncated?)"
    return f"unreadable header ({why})"


@contextlib.contextmanager
def _open(path: str) -> Iterator:
    """safe_open with its errors turned into a CorruptCheckpointError naming the file."""
    try:
        handle = safe_open(path, framework="numpy")
    except SafetensorError as e:
        raise CorruptCheckpointError(path, _explain(path, e)) from e
    with handle as f:
        yield f


def _checked_names(path: str, f) -> list[str]:
    """Tensor names in file order, each of a dtype the reader supports."""
    names = list(f.offset_keys())
    for name in names:
        dtype = f.get_slice(name).get_dtype()
        if dtype not in _NUMPY_DTYPES and dtype not in _RAW_DTYPES:
            raise UnsupportedDtypeError(path, name, dtype)
    return names


def tensor_names(path: str) -> list[str]:
    """Validate one file (header, size, dtypes) and list its tensors, reading no tensor data."""
    with _open(path) as f:
        return _checked_names(path, f)


def iterate_safetensors_file(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors of one file in file order, each read into its own fresh array (one host copy)."""
    with _open(path) as f:
        raw = None
        for name in _checked_names(path, f):
            try:
                if f.get_slice(name).get_dtype() in _RAW_DTYPES:
                    raw = raw if raw is not None else _RawTensors(path)
                    arr = raw.read(name)
                else:
                    arr = f.get_tensor(name)
            except SafetensorError as e:
                raise CorruptCheckpointError(path, f"tensor {name!r}: {e}") from e
            yield name, arr
            del arr  # the next tensor is read while the consumer has dropped this one


class _RawTensors:
    """Tensors of one (already validated) file read from its bytes by the header's offsets."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(n))
        self.data_start = 8 + n

    def read(self, name: str) -> np.ndarray:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        dtype = _RAW_DTYPES[entry["dtype"]]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            buf = f.read(end - begin)
        return np.frombuffer(buf, dtype=np.uint8).copy().view(dtype).reshape(entry["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file (bf16 via ml_dtypes), the inverse of iterate_safetensors_file."""
    supported = set(_NUMPY_DTYPES.values())
    contiguous = {}
    for name, arr in tensors.items():
        if arr.dtype not in supported:
            raise UnsupportedDtypeError(path, name, str(arr.dtype))
        contiguous[name] = np.ascontiguousarray(arr)
    save_file(contiguous, path, metadata=metadata or {"format": "pt"})
