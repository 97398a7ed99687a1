"""vLLM's quantization seam: a ``QuantizationConfig`` hands each layer a method with three steps.

- ``create_weights(layer, rngs)``: which Params the layer holds (names, shapes, dtypes and
  shardings), created on the layer under the checkpoint's names;
- ``weight_targets(layer, prefix)``: how each checkpoint tensor loads into them (the default:
  one tensor per Param of the same name, in the Param's layout);
- ``process_weights_after_loading(layer)``: once, after every tensor is in (repack, scale,
  quantize online);
- ``apply``: the product, inside the compiled step.

Methods hold no arrays (the Params live on the layer): they are frozen dataclasses, static
parts of the model's graph. The config chooses per layer by its path (``prefix``, the HF module
name), so a model never names a format.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
from flax import nnx

from jaxlm.models.utils import WeightTarget, hf_shape, to_param_layout


@dataclasses.dataclass(frozen=True)
class QuantizeMethodBase(abc.ABC):
    """The weights of one layer kind in one format."""

    # The names of the Params create_weights puts on the layer (its checkpoint tensors' suffixes).
    param_names: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def create_weights(self, layer: nnx.Module, rngs: nnx.Rngs) -> None:
        """Put this method's Params on ``layer`` (abstract under ``nnx.eval_shape``)."""

    def weight_targets(self, layer: nnx.Module, prefix: str) -> dict[str, WeightTarget]:
        """Checkpoint name -> where it loads: by default each Param from the tensor of its name."""
        targets = {}
        for name in self.param_names:
            param = getattr(layer, name)
            targets[f"{prefix}.{name}"] = WeightTarget(hf_shape(param), [(param, _layout(param))])
        return targets

    def process_weights_after_loading(self, layer: nnx.Module) -> None:
        """Once every tensor is loaded: repack, rescale or quantize the layer's Params in place."""

    def remove_weights(self, layer: nnx.Module) -> None:
        """Drop this method's Params (before another method creates its own)."""
        for name in self.param_names:
            if hasattr(layer, name):
                delattr(layer, name)


def _layout(param: nnx.Variable):
    return lambda a: to_param_layout(param, a)


@dataclasses.dataclass(frozen=True)
class LinearMethodBase(QuantizeMethodBase):
    """A ``Linear``'s weight [in, out] (in whatever bytes the format keeps)."""

    @abc.abstractmethod
    def apply(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
        """x [T, in] @ W -> [T, out] in x's dtype (bias and LoRA are the layer's)."""


@dataclasses.dataclass(frozen=True)
class FusedMoEMethodBase(QuantizeMethodBase):
    """The stacked experts of a ``FusedExperts``: every expert's gate/up and down products."""

    def weights(self, layer: nnx.Module) -> tuple[nnx.Variable, ...]:
        """The Params ``apply`` reads, in its order (each led by the expert dim, so a
        shard_map splits them like the experts)."""
        return tuple(getattr(layer, name) for name in self.param_names)

    @abc.abstractmethod
    def apply(self, layer: nnx.Module, weights: tuple[jax.Array, ...], xs: jax.Array, expert_ids: jax.Array,
              first_expert: jax.Array, act: Any) -> jax.Array:
        """Rows ``xs`` [N, hidden] sorted by ``expert_ids`` [N] through their experts' gated MLP;
        ``weights`` are this device's blocks of ``weights(layer)``, whose expert 0 is global
        expert ``first_expert``."""


class QuantizationConfig(abc.ABC):
    """One quantization format (vLLM's ``QuantizationConfig``), from a checkpoint's
    ``quantization_config`` or from ``--quantization``; hashable (part of the model's graph)."""

    # Whether get_quant_method is asked for the token embeddings too (GGUF keeps them in blocks);
    # the other formats see only Linear layers and experts.
    quantizes_embeddings: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def get_name(cls) -> str:
        """The ``quant_method`` / ``--quantization`` name."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig":
        """From the checkpoint's ``quantization_config`` ({} for online quantization)."""

    @abc.abstractmethod
    def get_quant_method(self, layer: nnx.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for the layer at ``prefix`` (its HF module name); None: leave it as it is."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.get_name()
