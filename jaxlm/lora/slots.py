"""The runner's adapter slots: which adapter sits in which device slot, and each token's slot.

Three tiers, as vLLM's LoRA manager: an adapter on disk (a PEFT directory), up to
``max_cpu_loras`` adapters read and laid out in host memory (LRU), and ``max_loras`` device slots
(LRU). A step's adapters always fit in the slots: the scheduler admits at most ``max_loras``
distinct adapters among running requests. Loading an adapter into a slot writes the slot's
columns of a host mirror of each stacked buffer and puts the buffers it changed back on the
device with ``jax.device_put`` onto their own sharding: a new array of the same shape and
sharding replaces the program input, so no program is compiled or added, ever. (A donated
in-place update would move only the adapter's bytes, but it is one more compiled program.)

The slot index per token goes to the step as one more int32 segment of its packed inputs
(``token_slots``); -1 runs the base model.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlm.config import LoRAConfig
from jaxlm.lora.errors import LoRAAdapterError
from jaxlm.lora.layers import LinearLoRA, lora_layers
from jaxlm.lora.peft import check_adapter, load_adapter
from jaxlm.lora.request import LoRARequest
from jaxlm.lora.targets import LoRATargets

logger = logging.getLogger(__name__)

AdapterWeights = dict[str, tuple[np.ndarray, np.ndarray]]


class LoRASlotManager:
    """Adapters for the runner: host cache, device slots, per-request adapters, token slots."""

    def __init__(self, model: nnx.Module, targets: LoRATargets, config: LoRAConfig, leaves: list[Any]):
        self.targets = targets
        self.max_loras, self.rank = config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras
        self._leaves = leaves  # the runner's flat program inputs, updated in place
        index = {id(leaf): i for i, leaf in enumerate(leaves)}
        self._layers: dict[str, tuple[LinearLoRA, int, int]] = {
            path: (lora, index[id(lora.lora_a.get_value())], index[id(lora.lora_b.get_value())])
            for path, lora in lora_layers(model)}
        first = next(iter(self._layers.values()))[0]
        self.dtype = first.lora_a.get_value().dtype
        # Host mirrors of the stacked buffers (A [in, S*R], B [S*R, out]), written per slot.
        self._host = {path: (np.zeros(lora.lora_a.get_value().shape, self.dtype),
                             np.zeros(lora.lora_b.get_value().shape, self.dtype))
                      for path, (lora, _, _) in self._layers.items()}
        self._cpu: collections.OrderedDict[int, tuple[LoRARequest, AdapterWeights]] = collections.OrderedDict()
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU: oldest first
        self._free_slots = list(range(self.max_loras - 1, -1, -1))
        self._req_lora: dict[str, LoRARequest] = {}
        self.num_slot_loads = 0
        self.last_load_seconds = 0.0

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, req_id: str, lora: LoRARequest | None) -> str | None:
        """Register a request's adapter and read it into host memory; the error text when the
        adapter cannot be read (the request then fails alone)."""
        if lora is None:
            return None
        try:
            self._host_weights(lora)
        except LoRAAdapterError as e:
            logger.error("request %s: %s", req_id, e)
            return str(e)
        self._req_lora[req_id] = lora
        return None

    def remove_request(self, req_id: str) -> None:
        self._req_lora.pop(req_id, None)

    # ---- one step ---------------------------------------------------------------------

    def token_slots(self, req_ids: list[str], token_to_req: np.ndarray, num_tokens: int,
                    padded: int) -> tuple[np.ndarray, dict[str, str]]:
        """[padded] int32 slot of each token (-1: none) for a step whose rows are ``req_ids``,
        and the requests whose adapter could not be loaded (they run without it and fail)."""
        out = np.full(padded, -1, np.int32)
        if not self._req_lora:
            return out, {}
        loras = [self._req_lora.get(r) for r in req_ids]
        wanted = {lr.lora_int_id: lr for lr in loras if lr is not None}
        if not wanted:
            return out, {}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step but max_loras={self.max_loras} "
                               "(the scheduler should have held some back)")
        failed: dict[str, str] = {}
        slots = {}
        for lid, lr in wanted.items():
            try:
                slots[lid] = self._ensure_slot(lr, set(wanted))
            except LoRAAdapterError as e:
                logger.error("%s", e)
                failed.update({r: str(e) for r, x in zip(req_ids, loras) if x is not None and x.lora_int_id == lid})
        row_slot = np.array([-1 if x is None else slots.get(x.lora_int_id, -1) for x in loras], np.int32)
        out[:num_tokens] = row_slot[token_to_req[:num_tokens]]
        return out, failed

    def _ensure_slot(self, lora: LoRARequest, in_step: set[int]) -> int:
        lid = lora.lora_int_id
        if lid in self._slot_of:
            self._slot_of.move_to_end(lid)
            return self._slot_of[lid]
        weights = self._host_weights(lora)
        if self._free_slots:
            slot = self._free_slots.pop()
        else:  # the least recently used adapter this step does not need
            victim = next(v for v in self._slot_of if v not in in_step)
            slot = self._slot_of.pop(victim)
        start = time.perf_counter()
        self._write_slot(slot, weights)
        self._slot_of[lid] = slot
        self.num_slot_loads += 1
        self.last_load_seconds = time.perf_counter() - start
        logger.info("LoRA adapter %s (id %d) loaded into slot %d in %.1f ms", lora.lora_name, lid, slot,
                    1e3 * self.last_load_seconds)
        return slot

    def _host_weights(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter's matrices in host memory (read from disk unless cached; LRU)."""
        lid = lora.lora_int_id
        if lid in self._cpu:
            self._cpu.move_to_end(lid)
            return self._cpu[lid][1]
        spec = check_adapter(lora.lora_name, lora.lora_path, self.targets, self.rank)
        weights = load_adapter(spec, self.dtype)
        self._cpu[lid] = (lora, weights)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
        return weights

    def _write_slot(self, slot: int, weights: AdapterWeights) -> None:
        """Slot ``slot`` of every layer := the adapter's matrices (zeros where it has none)."""
        cols = slice(slot * self.rank, (slot + 1) * self.rank)
        for path, (lora, ia, ib) in self._layers.items():
            host_a, host_b = self._host[path]
            pair = weights.get(path)
            if pair is None and not host_a[:, cols].any():
                continue  # was zero, stays zero: nothing to send
            host_a[:, cols] = 0
            host_b[cols, :] = 0
            if pair is not None:
                a, b = pair
                host_a[:, slot * self.rank:slot * self.rank + a.shape[1]] = a
                host_b[slot * self.rank:slot * self.rank + b.shape[0], :] = _repeat_kv(b, lora.kv_repeat)
            # A private copy each: the transfer is asynchronous (or aliases the host buffer on
            # CPU), and the mirror is written again by the next load.
            self._leaves[ia] = jax.device_put(host_a.copy(), self._leaves[ia].sharding)
            self._leaves[ib] = jax.device_put(host_b.copy(), self._leaves[ib].sharding)


def _repeat_kv(b: np.ndarray, kv_repeat: tuple[int, int] | None) -> np.ndarray:
    """B [r, out] with each KV head's columns repeated as the base layer repeats them."""
    if kv_repeat is None:
        return b
    r, head_dim = kv_repeat
    rank, out = b.shape
    return np.repeat(b.reshape(rank, out // head_dim, head_dim), r, axis=1).reshape(rank, -1)
