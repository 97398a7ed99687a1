"""MeshExecutor: one worker over a mesh of this process's devices (tensor and pipeline parallel).

vLLM runs one worker process per GPU and broadcasts each step to them; here one program
spans the devices of a ``jax.sharding.Mesh`` with axes ``("data", "model")``: the weights and
the KV cache carry PartitionSpecs over ``model``, XLA inserts the reductions after the
row-split linears, and attention runs per device on its own heads (shard_map).
Pipeline parallel adds a leading ``stage`` axis: ``("stage", "data", "model")``, one
tensor-parallel sub-mesh per stage, each running its own programs (worker/pipeline_runner.py).
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from jaxlm.executor.uniproc_executor import UniProcExecutor
from jaxlm.models.utils import DATA_AXIS, MODEL_AXIS, STAGE_AXIS

logger = logging.getLogger(__name__)


def check_tensor_parallel(hf_config, tp: int) -> None:
    """A clear error when ``tp`` does not divide what it splits (naming both numbers)."""
    heads = getattr(hf_config, "num_attention_heads", None) or getattr(hf_config, "n_head", None)
    if heads is None:
        raise ValueError("tensor parallel needs num_attention_heads in the model config")
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's num_attention_heads={heads}")
    if kv_heads % tp and tp % kv_heads:
        # Fewer KV heads than devices are replicated, which needs tp to be a multiple of them.
        raise ValueError(
            f"tensor_parallel_size={tp} neither divides nor is a multiple of the model's "
            f"num_key_value_heads={kv_heads}")


def make_mesh(tp: int, devices: list | None = None, pp: int = 1) -> jax.sharding.Mesh:
    """A ("data", "model") mesh over the first ``tp`` devices, or with ``pp`` > 1 a ("stage",
    "data", "model") mesh over the first ``pp * tp`` (stage s: devices [s*tp, (s+1)*tp));
    an error when there are fewer."""
    devices = jax.devices() if devices is None else devices
    if len(devices) < tp * pp:
        sizes = f"tensor_parallel_size={tp}" + (f" x pipeline_parallel_size={pp}" if pp > 1 else "")
        raise ValueError(
            f"{sizes} needs {tp * pp} devices, but only {len(devices)} "
            f"{jax.default_backend()} device(s) are visible")
    if pp == 1:
        return jax.sharding.Mesh(np.array(devices[:tp]).reshape(1, tp), (DATA_AXIS, MODEL_AXIS))
    return jax.sharding.Mesh(np.array(devices[:tp * pp]).reshape(pp, 1, tp), (STAGE_AXIS, DATA_AXIS, MODEL_AXIS))


class MeshExecutor(UniProcExecutor):
    """The same single in-process worker, over a mesh of ``tp * pp`` devices."""

    def _make_mesh(self) -> jax.sharding.Mesh:
        tp = self.config.parallel_config.tensor_parallel_size
        pp = self.config.parallel_config.pipeline_parallel_size
        mesh = make_mesh(tp, pp=pp)
        check_tensor_parallel(self.config.model_config.hf_config, tp)
        logger.info("MeshExecutor: tensor parallel %d x pipeline parallel %d over devices %s",
                    tp, pp, mesh.devices.ravel().tolist())
        return mesh
