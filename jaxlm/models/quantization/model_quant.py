"""The model-wide steps of the seam: give each layer its method at construction, and process
every layer's weights once the checkpoint is loaded (seed 003's ``process_weights_after_loading``
after ``load_weights``)."""

from __future__ import annotations

from typing import Iterator

from flax import nnx

from jaxlm.models.quantization.base_config import QuantizationConfig


def quantizable_layers(model: nnx.Module) -> Iterator[tuple[str, nnx.Module]]:
    """(path = HF module name, layer) of every layer that owns a quantization method."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "quant_method"):
            yield ".".join(str(p) for p in path), node


def apply_quantization_config(model: nnx.Module, quant_config: QuantizationConfig, rngs: nnx.Rngs) -> int:
    """Swap in the config's method on every layer it quantizes; returns how many."""
    from jaxlm.models.layers import Embedding

    count = 0
    for prefix, layer in list(quantizable_layers(model)):
        if not getattr(layer, "quantizable", True):
            continue
        if isinstance(layer, Embedding) and not quant_config.quantizes_embeddings:
            continue
        method = quant_config.get_quant_method(layer, prefix)
        if method is not None:
            try:
                layer.set_quant_method(method, rngs)
            except ValueError as e:  # a layer the format cannot hold: say which
                raise ValueError(f"{prefix}: {e}") from None
            count += 1
    return count


def process_weights_after_loading(model: nnx.Module) -> None:
    """Each layer's method, once, after the last tensor is placed."""
    for _, layer in list(quantizable_layers(model)):
        layer.quant_method.process_weights_after_loading(layer)
