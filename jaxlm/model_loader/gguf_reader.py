"""A lean GGUF reader: metadata and tensor index in milliseconds, tensor bytes through one memmap.

``gguf.GGUFReader`` builds a numpy view for every part of every field, which for a vocabulary
of 49k tokens + 49k merges costs seconds per open (and the engine opens a file to resolve the
config, for the chat template and to load). Here large string arrays are skipped unless asked
for, and the tensors are read lazily; dequantization still uses ``gguf.quants``.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import numpy as np

from jaxlm.model_loader.errors import CorruptCheckpointError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value type id → struct format of a scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dims fastest-first; reversed here)
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: Any, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as e:
            raise CorruptCheckpointError(self.path, f"GGUF header ends early at byte {self.pos}") from e
        self.pos += struct.calcsize("<" + fmt)
        return v

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise CorruptCheckpointError(self.path, f"GGUF string at byte {self.pos} runs past the end")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, vtype: int, keep_string_arrays: bool) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise CorruptCheckpointError(self.path, f"unknown GGUF value type {vtype} at byte {self.pos}")
        item, count = self.take("I"), self.take("Q")
        if item in _NUMPY:
            dt = np.dtype(_NUMPY[item]).newbyteorder("<")
            end = self.pos + count * dt.itemsize
            if end > len(self.buf):
                raise CorruptCheckpointError(self.path, f"GGUF array at byte {self.pos} runs past the end")
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
            self.pos = end
            return arr
        if item == _STRING:
            if keep_string_arrays:
                return [self.string() for _ in range(count)]
            try:
                for _ in range(count):
                    self.skip_string()
            except struct.error as e:
                raise CorruptCheckpointError(self.path, "GGUF string array runs past the end") from e
            return _SkippedArray(count)
        return [self.value(item, keep_string_arrays) for _ in range(count)]


@dataclasses.dataclass(frozen=True)
class _SkippedArray:
    """A string array not materialized (vocabularies): only its length is kept."""

    length: int

    def __len__(self) -> int:
        return self.length


class GGUFFile:
    """Metadata (``fields``: key → value) and tensor index of one GGUF file."""

    def __init__(self, path: str, *, keep_string_arrays: bool = False):
        self.path = path
        self.size = os.path.getsize(path)
        with open(path, "rb") as f:
            if self.size < 24:
                raise CorruptCheckpointError(path, f"file is {self.size} bytes, too short for GGUF")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(buf, keep_string_arrays)
        finally:
            buf.close()

    def _parse(self, buf: Any, keep: bool) -> None:
        c = _Cursor(buf, self.path)
        if bytes(buf[:4]) != _MAGIC:
            raise CorruptCheckpointError(self.path, "not a GGUF file (bad magic)")
        c.pos = 4
        self.version = c.take("I")
        if self.version not in (2, 3):
            raise CorruptCheckpointError(self.path, f"unsupported GGUF version {self.version} (or big-endian file)")
        n_tensors, n_kv = c.take("Q"), c.take("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            self.fields[key] = c.value(c.take("I"), keep)
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("Q") for _ in range(c.take("I"))]
            infos.append((name, tuple(reversed(dims)), c.take("I"), c.take("Q")))
        align = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = c.pos + (-c.pos % align)
        self.tensors = [self._info(name, shape, qtype, data_start + off) for name, shape, qtype, off in infos]

    def _info(self, name: str, shape: tuple[int, ...], qtype: int, offset: int) -> GGUFTensorInfo:
        import gguf

        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            block, type_size = 1, 0  # unknown type: reported when the tensor is read
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        if offset + nbytes > self.size:
            raise CorruptCheckpointError(
                self.path, f"tensor {name!r} ends at byte {offset + nbytes}, the file has only {self.size} bytes"
            )
        return GGUFTensorInfo(name, shape, qtype, offset, nbytes)

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes (a read-only view of one file memmap: no copy until dequantized)."""
        if getattr(self, "_mm", None) is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm[info.offset:info.offset + info.nbytes]
