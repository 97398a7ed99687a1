"""Safetensors checkpoints read tensor by tensor (bf16 included) with every failure named.

The reader parses the header itself instead of ``safe_open(framework="numpy")``: numpy has no
bf16, and checking offsets against the file size up front turns a truncated download into a
CorruptCheckpointError naming the file instead of a crash halfway through the load.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from jaxlm.model_loader.errors import CorruptCheckpointError, NoWeightsError, UnsupportedDtypeError
from jaxlm.model_loader.formats import SAFETENSORS_INDEX

logger = logging.getLogger(__name__)

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024


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


def read_header(path: str) -> tuple[dict, int]:
    """(tensor entries, byte offset of the data section), validated against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(path, f"file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CorruptCheckpointError(path, f"header length {n} exceeds the file size {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(path, f"unreadable header ({e})") from e
    header.pop("__metadata__", None)
    data_start = 8 + n
    data_size = size - data_start
    for name, entry in header.items():
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            dtype = entry["dtype"]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(path, f"bad header entry for {name!r} ({e})") from e
        if end > data_size:
            raise CorruptCheckpointError(
                path, f"tensor {name!r} ends at byte {data_start + end}, the file has only {size} bytes"
            )
        if dtype not in _DTYPES:
            raise UnsupportedDtypeError(path, name, dtype)
        if end - begin != int(np.prod(shape)) * _DTYPES[dtype].itemsize:
            raise CorruptCheckpointError(path, f"tensor {name!r}: {end - begin} bytes do not fit {dtype}{list(shape)}")
    return header, data_start


def iterate_safetensors_file(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors of one file in file order, each read into its own fresh array (one host copy)."""
    header, data_start = read_header(path)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    with open(path, "rb") as f:
        for name, entry in entries:
            begin, end = entry["data_offsets"]
            arr = np.empty(tuple(entry["shape"]), dtype=_DTYPES[entry["dtype"]])
            f.seek(data_start + begin)
            got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
            if got != end - begin:
                raise CorruptCheckpointError(path, f"tensor {name!r}: read {got} of {end - begin} bytes")
            yield name, arr


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file (bf16 via ml_dtypes), the inverse of iterate_safetensors_file."""
    inverse = {v: k for k, v in _DTYPES.items()}
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in inverse:
            raise UnsupportedDtypeError(path, name, str(arr.dtype))
        header[name] = {"dtype": inverse[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
