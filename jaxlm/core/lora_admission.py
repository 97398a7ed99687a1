"""Which waiting requests may start, given the adapters (LoRA) already running.

Each running adapter holds a device slot, and there are ``max_loras`` of them, so at most that
many distinct adapters run at once (base-model requests need no slot). A request for another
adapter waits, keeping its place in the queue. Fairness: once such a request waits, no later
request for any adapter starts before it (base-model requests still may), so the running
adapters drain and it gets a slot: a busy adapter cannot starve a quiet one.
"""

from __future__ import annotations

from typing import Iterable

from jaxlm.core.request import Request


class LoRAAdmission:
    """One step's admission check (``begin`` with the running requests, then ``admits`` per request
    in queue order)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._active: set[int] = set()
        self._held = False

    def begin(self, running: Iterable[Request]) -> None:
        self._active = {r.lora_int_id for r in running} - {0}
        self._held = False

    def admits(self, request: Request) -> bool:
        """Whether ``request`` may start now (its adapter then counts as running)."""
        lid = request.lora_int_id
        if lid == 0:
            return True
        if self._held:
            return False  # an older request waits for a slot: adapters queue behind it
        if lid in self._active or len(self._active) < self.max_loras:
            self._active.add(lid)
            return True
        self._held = True
        return False


def lora_counts(requests: Iterable[Request]) -> dict[str, int]:
    """Adapter name -> requests using it (vLLM's running/waiting adapters, for the metrics)."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts
