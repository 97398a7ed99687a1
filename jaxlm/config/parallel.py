"""ParallelConfig: how the model is spread over devices (TP, PP, DP, several nodes)."""

from __future__ import annotations

import dataclasses
import logging
import os

from jaxlm.config.utils import arg

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ParallelConfig:
    """How the model is spread over devices."""

    tensor_parallel_size: int = arg(1, "devices the weights are split over (mesh axis 'model')", flags=("-tp",))
    pipeline_parallel_size: int = arg(
        1, "pipeline stages: contiguous layer ranges, each on its own tensor-parallel sub-mesh (mesh axis "
           "'stage'); a step's requests run as micro-batches so the stages overlap", flags=("-pp",))
    # vLLM's meaning: engine-core processes, each with its own devices, KV cache and scheduler,
    # behind one front end (the server only; each core is itself a tp x pp mesh).
    data_parallel_size: int = arg(1, "engine-core processes (replicas of the model), each on its own devices",
                                  flags=("-dp",))
    # vLLM's flag: MoE experts whole on the tensor-parallel axis, as evenly as they go (the first
    # num_experts % tp devices hold one more; tokens reach them under shard_map); without it each
    # expert is split like the MLP.
    enable_expert_parallel: bool = arg(
        False, "MoE models: place whole experts on the tensor-parallel devices, as evenly as they go (10 "
               "experts on 4 devices: 3, 3, 2, 2) instead of splitting every expert; attention stays tensor "
               "parallel")
    # Several hosts (vLLM's multi-node flags): one process per node, one global mesh over all
    # their devices; the flags default to JAX's JAX_NUM_PROCESSES / JAX_PROCESS_ID /
    # JAX_COORDINATOR_ADDRESS when those are set (jaxlm.executor.distributed).
    nnodes: int = arg(1, "nodes (one process each) the model spans; the world size is over all of them")
    node_rank: int = arg(0, "this node's rank: 0 serves the API and schedules, the others run --headless")
    master_addr: str = arg("127.0.0.1", "address of the rank-0 node (JAX coordinator on --master-port, "
                                        "step broadcast on the next two ports)")
    master_port: int = arg(29501, "port of the JAX coordinator on the rank-0 node")
    headless: bool = arg(False, "serve no API: run this node's worker for the rank-0 node (node_rank > 0)")
    distributed_timeout_seconds: int = arg(
        30, "seconds a step or a silent peer node may take before the engine is declared dead")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes",
                     "distributed_timeout_seconds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be true or false, got {self.enable_expert_parallel!r}")
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            logger.warning("--enable-expert-parallel spreads the experts over each engine core's %d tensor-parallel "
                           "device(s), not across the %d -dp cores: each core holds every expert",
                           self.tensor_parallel_size, self.data_parallel_size)
        self._from_jax_environment()
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.headless and self.node_rank == 0:
            raise ValueError("--headless is for the nodes with --node-rank > 0 (rank 0 schedules and serves)")
        if not 0 < self.master_port < 65534:
            raise ValueError(
                f"master_port={self.master_port} must be in (0, 65534) (the next two ports are used too)")

    def _from_jax_environment(self) -> None:
        """JAX's usual variables (JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_COORDINATOR_ADDRESS=
        host:port) stand in for the flags when the flags leave one node."""
        num = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
        if self.nnodes > 1 or num <= 1:
            return
        address = os.environ.get("JAX_COORDINATOR_ADDRESS", "")
        if ":" not in address:
            raise ValueError(
                f"JAX_NUM_PROCESSES={num} needs JAX_COORDINATOR_ADDRESS=host:port, got {address!r}")
        self.master_addr, port = address.rsplit(":", 1)
        self.nnodes, self.master_port = num, int(port)
        self.node_rank = int(os.environ.get("JAX_PROCESS_ID", "0"))

    @property
    def world_size(self) -> int:
        """Devices of one engine core (data-parallel replicas each have their own)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
