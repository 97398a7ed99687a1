"""Several hosts: ``jax.distributed`` from vLLM's multi-node flags (or JAX's environment).

One process per node. Node 0 runs the coordinator of ``jax.distributed`` on ``master_port`` and
the step channel on the next two ports (jaxlm.executor.multihost_channel); ``jax.devices()``
is then the global device list and one mesh spans every node's devices.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jaxlm.config import ParallelConfig

logger = logging.getLogger(__name__)

# JAX's heartbeat aborts the process: only a backstop behind the step channel's own heartbeats
# (measured: shorter ones fired on live, busy nodes while both loaded and compiled).
_JAX_HEARTBEAT_MIN_S = 100


def init_distributed(parallel: ParallelConfig) -> None:
    """``jax.distributed.initialize`` for this node (once per process, before anything touches a
    backend; nothing for one node).

    JAX's own heartbeat aborts a process whose peer stopped beating; it is the backstop, so it
    waits longer than the executor's watchdog, which turns a lost node into an engine error."""
    if parallel.nnodes == 1 or jax.distributed.is_initialized():
        return
    # CPU devices of different processes talk through gloo (the default has no collectives);
    # GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = parallel.distributed_timeout_seconds
    logger.info("jax.distributed: node %d of %d, coordinator %s:%d", parallel.node_rank, parallel.nnodes,
                parallel.master_addr, parallel.master_port)
    jax.distributed.initialize(
        coordinator_address=f"{parallel.master_addr}:{parallel.master_port}",
        num_processes=parallel.nnodes, process_id=parallel.node_rank,
        initialization_timeout=max(timeout, 300),  # followers may start minutes after rank 0
        heartbeat_timeout_seconds=max(_JAX_HEARTBEAT_MIN_S, 2 * timeout),
        shutdown_timeout_seconds=min(timeout, 10))
    # Starting the backend is collective (every node's CPU client joins the same gloo group):
    # do it now on every node, before rank 0 needs it and a follower waits for rank 0's config.
    logger.info("jax.distributed: %d devices over %d nodes", len(jax.devices()), jax.process_count())


def check_world_size(parallel: ParallelConfig) -> None:
    """Every device of every node belongs to the one mesh: a clear error otherwise."""
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    if world != jax.device_count():
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {world} must equal the devices of all "
            f"{parallel.nnodes} nodes ({jax.device_count()}: {jax.local_device_count()} on this one)")


def place_inputs(tree: Any, sharding: jax.sharding.Sharding | None) -> Any:
    """Host arrays (a pytree) -> device arrays on ``sharding`` (None: the default device): the
    one placement of step inputs and sampling metadata, at warm-up as at serving.

    Over several nodes every node holds the same inputs (built from the same SchedulerOutput),
    so each puts its own copy on its own devices and the pieces form one global array: no
    program, no collective (``jax.device_put`` onto a multi-process sharding would run and
    compile an all-gather per shape)."""
    if sharding is None:
        return jax.device_put(tree)
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)
    if not sharding.is_fully_replicated:
        raise ValueError(f"step inputs over several nodes must be replicated, got {sharding}")
    devices = list(sharding.addressable_devices)

    def place(x: Any) -> jax.Array:
        x = np.asarray(x)
        copies = jax.device_put([x] * len(devices), devices)
        return jax.make_array_from_single_device_arrays(x.shape, sharding, copies)

    return jax.tree.map(place, tree)
