"""What crosses between the front end and an engine core (vLLM's names): msgspec Structs sent as
msgpack over ZMQ, one message per batch. numpy arrays (logprobs) travel as raw bytes in a msgpack
extension; nothing is pickled."""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np

from jaxlm.core.outputs import EngineCoreOutputBatch
from jaxlm.core.stats import SchedulerStats
from jaxlm.lora.request import LoRARequest
from jaxlm.multimodal.inputs import MultiModalFeatureSpec
from jaxlm.sampling_params import SamplingParams

_NDARRAY_EXT = 1

# The first frame of every core -> front end message.
MSG_READY = b"R"  # EngineCoreReady: built and warmed up
MSG_FAILED = b"F"  # (engine index, exception type, message): the core could not start
MSG_OUTPUTS = b"O"  # EngineCoreOutputs


class EngineCoreRequestType(enum.Enum):
    """The first frame of every front end -> core message. ADD carries one user request's
    sequences (n > 1: the first child, then its siblings), ABORT a list of core ids."""

    ADD = b"\x00"
    ABORT = b"\x01"
    SHUTDOWN = b"\x02"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence for the core's scheduler (a child of an n > 1 request is one each)."""

    request_id: str  # the internal (routing) id
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0  # --scheduling-policy priority (the front end checked it)
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeatureSpec] | None = None  # its images, in prompt order


class EngineCoreRejection(msgspec.Struct, array_like=True):
    """An add the core refused (nothing of it was queued)."""

    request_id: str
    queue_full: bool  # True: QueueFullError (HTTP 429), else ValueError (HTTP 400)
    message: str


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One batch from a core: a step's outputs, and the core's load and stats after it."""

    engine_index: int = 0
    # The step's outputs, columnar (see EngineCoreOutputBatch).
    outputs: EngineCoreOutputBatch = msgspec.field(default_factory=EngineCoreOutputBatch)
    # Core request id -> why its host-side work failed this step (it finished with "error").
    failed: dict[str, str] = {}
    rejected: list[EngineCoreRejection] = []
    scheduler_stats: SchedulerStats | None = None
    # Adds this core has taken off its socket so far: the client counts the ones in flight.
    num_adds_seen: int = 0
    # Set once, on the last message of a core whose loop failed: every request is lost.
    engine_dead: str | None = None


class EngineCoreReady(msgspec.Struct, array_like=True):
    """The startup handshake, after warm-up: what the front end needs from the built core."""

    engine_index: int
    num_gpu_blocks: int
    model_weight_bytes: int = 0


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(_NDARRAY_EXT, msgspec.msgpack.encode((arr.dtype.str, arr.shape, arr.tobytes())))
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to or from an engine core")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code} in an engine-core message")
    dtype, shape, buf = msgspec.msgpack.decode(data)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {kind!r} in an engine-core message")


class MsgpackEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)


class MsgpackDecoder:
    def __init__(self, kind: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook, ext_hook=_ext_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)
