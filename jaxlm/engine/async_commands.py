"""What AsyncLLMEngine's event loop and its engine thread exchange: the commands the loop queues
(add, abort) and the per-request stream outputs come back on."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from jaxlm.sampling_params import SamplingParams


@dataclasses.dataclass
class Stream:
    """One request's way back to its caller: the caller's event loop and its queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | BaseException items
    request_id: str  # the client's
    num_seqs: int = 1  # the request's n


@dataclasses.dataclass
class AddCommand:
    """A request the event loop hands the engine thread."""

    request_id: str  # the client's
    internal_id: str
    prompt: Any
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    lora_request: Any = None


@dataclasses.dataclass
class AbortCommand:
    """Requests (internal ids) the event loop asks the engine thread to abort."""

    internal_ids: list[str]
