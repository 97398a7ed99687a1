"""Orbax checkpoints of loaded models: save once, then restore straight into device shardings.

Layout of a checkpoint directory:
  config.json          the HF config (so resolve_model_config works on the directory alone)
  tokenizer files      when a tokenizer is given
  jaxlm_orbax.json     marker: format version, dtype, parameter names
  params/              orbax tree: flat {"dotted.state.path": array}

Parameters whose layout depends on the tensor-parallel size (KV heads repeated when TP exceeds
them, vocabulary rows padded for an even split) are stored in the checkpoint's own shape (HF
layout: no repeats, no padding), so a checkpoint restores at any TP size; the rest are stored in
the Param's layout and restored straight into their shardings.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlm.model_loader.errors import CorruptCheckpointError, MissingWeightsError, NoWeightsError
from jaxlm.model_loader.formats import ORBAX_MARKER, ORBAX_PARAMS_DIR

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 2  # 2: TP-dependent Params stored without repeats or padding


def _flat_params(model: nnx.Module) -> dict[str, Any]:
    """{"a.b.0.kernel": Param} — string keys only, which every orbax handler accepts."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): var for path, var in flat}


def save_orbax(model: nnx.Module, path: str, hf_config: Any, tokenizer: Any = None) -> None:
    """Write the model's parameters (and config, tokenizer) as a checkpoint load_format=orbax reads."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    from jaxlm.models.utils import is_tensor_parallel_layout

    params = {k: _to_stored(v, np.asarray(v.get_value())) if is_tensor_parallel_layout(v) else v.get_value()
              for k, v in _flat_params(model).items()}
    dtypes = sorted({str(a.dtype) for a in params.values()})
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, ORBAX_PARAMS_DIR), params, force=True)
    ckptr.wait_until_finished()
    hf_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    with open(os.path.join(path, ORBAX_MARKER), "w") as f:
        json.dump({"format_version": _FORMAT_VERSION, "dtypes": dtypes, "params": sorted(params)}, f, indent=1)
    logger.info("saved %d parameters to %s", len(params), path)


def _transposed(var: Any) -> bool:
    from jaxlm.models.utils import HF_TRANSPOSE

    return var.get_metadata().get("hf_layout") == HF_TRANSPOSE


def _to_stored(var: Any, array: np.ndarray) -> np.ndarray:
    """A TP-dependent Param as stored: the Param's orientation, without repeats or padding."""
    from jaxlm.models.utils import to_hf_layout

    hf = to_hf_layout(var, array)
    return np.ascontiguousarray(hf.T) if _transposed(var) else hf


def _from_stored(var: Any, array: np.ndarray) -> np.ndarray:
    from jaxlm.models.utils import to_param_layout

    return to_param_layout(var, array.T if _transposed(var) else array)


def _target_sharding(var: Any, mesh: Any) -> Any:
    """The sharding load_weights would have placed the Param on (its PartitionSpec on mesh)."""
    from jaxlm.models.utils import param_sharding

    sharding = param_sharding(var, mesh)
    return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])


def restore_orbax(model: nnx.Module, path: str, mesh: Any = None) -> None:
    """Fill an abstract model's parameters from ``path``, each restored into its target sharding."""
    import orbax.checkpoint as ocp

    mesh = mesh if mesh is not None else getattr(model, "mesh", None)

    path = os.path.abspath(path)
    marker = os.path.join(path, ORBAX_MARKER)
    if not os.path.isfile(marker):
        raise NoWeightsError(path, f"not a jaxlm orbax checkpoint (no {ORBAX_MARKER})")
    try:
        with open(marker) as f:
            saved_names = set(json.load(f)["params"])
    except (ValueError, KeyError) as e:
        raise CorruptCheckpointError(marker, str(e)) from e
    variables = _flat_params(model)
    missing = sorted(set(variables) - saved_names)
    if missing:
        raise MissingWeightsError(path, missing)
    extra = sorted(saved_names - set(variables))
    if extra:
        from jaxlm.model_loader.errors import UnexpectedWeightError

        raise UnexpectedWeightError(path, extra[0])
    # Pipeline parallel: each Param onto its stage's sub-mesh (empty otherwise).
    stage_meshes = model.placement_meshes() if hasattr(model, "placement_meshes") else {}
    from jaxlm.models.utils import hf_shape, is_tensor_parallel_layout, place

    # TP-dependent Params come back in the checkpoint's shape on the host, then take this TP's
    # repeats and padding on their way to the devices (one tensor's extra host copy at a time).
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    reshaped = {k for k, v in variables.items() if is_tensor_parallel_layout(v)}
    target = {}
    for k, v in variables.items():
        value = v.get_value()
        if k in reshaped:
            shape = hf_shape(v)
            stored = shape[::-1] if _transposed(v) else shape
            target[k] = jax.ShapeDtypeStruct(stored, value.dtype, sharding=host)
        else:
            target[k] = jax.ShapeDtypeStruct(value.shape, value.dtype,
                                             sharding=_target_sharding(v, stage_meshes.get(id(v), mesh)))
    try:
        restored = ocp.StandardCheckpointer().restore(os.path.join(path, ORBAX_PARAMS_DIR), target)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CorruptCheckpointError(path, f"orbax restore failed ({type(e).__name__}: {e})") from e
    # The flat state holds the model's own Variable objects: setting them fills the model.
    for k, var in variables.items():
        if k in reshaped:
            stored = np.asarray(restored.pop(k))
            place(var, _from_stored(var, stored), stored.dtype, stage_meshes.get(id(var), mesh))
        else:
            var.set_value(restored[k])
