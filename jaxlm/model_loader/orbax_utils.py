"""Orbax checkpoints of loaded models: save once, then restore straight into device shardings.

Layout of a checkpoint directory:
  config.json          the HF config (so resolve_model_config works on the directory alone)
  tokenizer files      when a tokenizer is given
  jaxlm_orbax.json     marker: format version, dtype, parameter names
  params/              orbax tree: flat {"dotted.state.path": array}
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
from flax import nnx

from jaxlm.model_loader.errors import CorruptCheckpointError, MissingWeightsError, NoWeightsError
from jaxlm.model_loader.formats import ORBAX_MARKER, ORBAX_PARAMS_DIR

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1


def _flat_params(model: nnx.Module) -> dict[str, Any]:
    """{"a.b.0.kernel": Param} — string keys only, which every orbax handler accepts."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): var for path, var in flat}


def save_orbax(model: nnx.Module, path: str, hf_config: Any, tokenizer: Any = None) -> None:
    """Write the model's parameters (and config, tokenizer) as a checkpoint load_format=orbax reads."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    params = {k: v.get_value() for k, v in _flat_params(model).items()}
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
    target = {
        k: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                sharding=_target_sharding(v, stage_meshes.get(id(v), mesh)))
        for k, v in variables.items()
    }
    try:
        restored = ocp.StandardCheckpointer().restore(os.path.join(path, ORBAX_PARAMS_DIR), target)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CorruptCheckpointError(path, f"orbax restore failed ({type(e).__name__}: {e})") from e
    # The flat state holds the model's own Variable objects: setting them fills the model.
    for k, var in variables.items():
        var.set_value(restored[k])
