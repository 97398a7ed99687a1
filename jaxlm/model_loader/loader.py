"""get_model(): checkpoint path → fully loaded flax.nnx model (vLLM's model_loader, for JAX).

The model is first built abstractly (``nnx.eval_shape``: shapes, dtypes and shardings, no
memory), then each weight is streamed from disk into ``model.load_weights`` which places it on
its device(s). Host memory thus peaks near one tensor, not one model. Any failure raises a
WeightLoadError naming the real file; a partially loaded model is never returned.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from flax import nnx

from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader.errors import MissingWeightsError, UnsupportedModelError, WeightLoadError
from jaxlm.model_loader.formats import detect_load_format, find_gguf_file
from jaxlm.model_loader.resolve import get_jax_dtype

logger = logging.getLogger(__name__)

def get_model_class(model_config: ModelConfig) -> type:
    from jaxlm.models.registry import get_model_architecture

    try:
        return get_model_architecture(model_config.hf_config)
    except WeightLoadError:
        raise
    except (ValueError, KeyError, NotImplementedError) as e:
        raise UnsupportedModelError(str(model_config.model), str(e)) from e


def init_abstract_model(model_config: ModelConfig, *, attn_backend: Any, mesh: Any = None,
                        enable_expert_parallel: bool = False) -> nnx.Module:
    """The model with abstract (ShapeDtypeStruct) parameters: nothing allocated yet."""
    from jaxlm.models.quantization import get_quantization_config

    cls = get_model_class(model_config)
    dtype = get_jax_dtype(model_config)
    quant_config = get_quantization_config(getattr(model_config, "quantization", None), model_config.hf_config)
    return nnx.eval_shape(
        lambda: cls(model_config.hf_config, dtype=dtype, attn_backend=attn_backend,
                    rngs=nnx.Rngs(model_config.seed), mesh=mesh, max_model_len=model_config.max_model_len,
                    enable_expert_parallel=enable_expert_parallel, quant_config=quant_config)
    )


def abstract_leaves(model: nnx.Module) -> list[str]:
    """State paths still abstract after loading: what the weights never reached."""
    import jax

    flat = nnx.to_flat_state(nnx.state(model))
    return [".".join(map(str, path)) for path, var in flat
            if isinstance(var.get_value() if isinstance(var, nnx.Variable) else var, jax.ShapeDtypeStruct)]


class BaseModelLoader(abc.ABC):
    """One checkpoint format: yields (source file, HF name, array) in HF layout."""

    def __init__(self, load_config: LoadConfig):
        self.load_config = load_config

    @abc.abstractmethod
    def iterate_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, str, np.ndarray]]:
        ...

    def count_weights(self, model_config: ModelConfig) -> int | None:
        return None

    def load_model(self, model_config: ModelConfig, *, attn_backend: Any, mesh: Any = None,
                   enable_expert_parallel: bool = False) -> nnx.Module:
        t0 = time.perf_counter()
        model = init_abstract_model(model_config, attn_backend=attn_backend, mesh=mesh,
                                    enable_expert_parallel=enable_expert_parallel)
        self.load_weights(model, model_config)
        logger.info("loaded %s in %.2f s", model_config.model, time.perf_counter() - t0)
        return model

    def load_weights(self, model: nnx.Module, model_config: ModelConfig) -> None:
        from jaxlm.models.quantization.model_quant import process_weights_after_loading

        source = str(model_config.model)
        current = [source]  # the file the tensor in flight came from

        def stream() -> Iterable[tuple[str, np.ndarray]]:
            from tqdm.auto import tqdm

            # Each tensor is cast on the host by ``place`` to its Param's dtype (the model's, or a
            # quantized format's: fp8 weights, float32 scales), one tensor at a time.
            for file, name, arr in tqdm(self.iterate_weights(model_config), total=self.count_weights(model_config),
                                        desc="Loading weights", unit="tensor", disable=None, leave=False):
                current[0] = file
                yield name, arr
                del arr  # not held while the next tensor is read

        try:
            loaded = set(model.load_weights(stream(), source=source))
        except WeightLoadError as e:
            if e.source != source:  # raised by our readers: already names its file
                raise
            raise e.with_source(current[0]) from e
        missing = set(model.expected_weight_names()) - loaded
        if missing:
            raise MissingWeightsError(source, sorted(missing))
        still_abstract = abstract_leaves(model)
        if still_abstract:
            raise MissingWeightsError(source, still_abstract)
        # Seed 003's order: quantization (repack, rescale, quantize online) after load_weights.
        process_weights_after_loading(model)


class DefaultModelLoader(BaseModelLoader):
    """HF safetensors: one file, a directory of files, or a sharded index."""

    def _files(self, model_config: ModelConfig) -> list[str]:
        from jaxlm.model_loader.safetensors_utils import list_safetensors_files

        return list_safetensors_files(str(model_config.model))

    def count_weights(self, model_config: ModelConfig) -> int | None:
        from jaxlm.model_loader.safetensors_utils import tensor_names

        # Opening every shard first also rejects a truncated one before anything is placed.
        return sum(len(tensor_names(f)) for f in self._files(model_config))

    def iterate_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, str, np.ndarray]]:
        from jaxlm.model_loader.safetensors_utils import iterate_safetensors_file

        for file in self._files(model_config):
            for name, arr in iterate_safetensors_file(file):
                yield file, name, arr


class GGUFModelLoader(BaseModelLoader):
    """llama.cpp GGUF files (llama, qwen2): the tensors the model keeps in GGUF blocks
    (``--quantization gguf``, models/quantization/gguf.py) as the file's bytes, the others
    dequantized to float on the host tensor by tensor (through the converted-weights cache when
    nothing is kept in blocks)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self._blocks: frozenset[str] = frozenset()  # of the model being loaded

    def load_weights(self, model: nnx.Module, model_config: ModelConfig) -> None:
        from jaxlm.model_loader.gguf_utils import log_dequantized_types, open_gguf
        from jaxlm.models.quantization.gguf import GGUFConfig, gguf_block_names

        self._blocks = gguf_block_names(model)
        if isinstance(getattr(model, "quant_config", None), GGUFConfig):
            path = find_gguf_file(str(model_config.model))
            log_dequantized_types(open_gguf(path), path, self._blocks)
        try:
            super().load_weights(model, model_config)
        finally:
            self._blocks = frozenset()

    def iterate_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, str, np.ndarray]]:
        from jaxlm.model_loader.gguf_cache import cached_gguf_weights
        from jaxlm.model_loader.gguf_utils import iterate_gguf_weights, open_gguf

        path = find_gguf_file(str(model_config.model))
        if self._blocks:  # the blocks need no conversion: read from the file itself
            weights = iterate_gguf_weights(open_gguf(path), path, self._blocks)
        else:
            weights = cached_gguf_weights(path, lambda: iterate_gguf_weights(open_gguf(path), path))
        for name, arr in weights:
            yield path, name, arr


class OrbaxModelLoader(BaseModelLoader):
    """Checkpoints written by save_orbax(): restored straight into each parameter's sharding."""

    def iterate_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, str, np.ndarray]]:
        raise NotImplementedError("orbax checkpoints restore whole states, not tensor streams")

    def load_model(self, model_config: ModelConfig, *, attn_backend: Any, mesh: Any = None,
                   enable_expert_parallel: bool = False) -> nnx.Module:
        from jaxlm.model_loader.orbax_utils import restore_orbax

        if model_config.quantization is not None:
            # A quantized model's Params change after loading (process_weights_after_loading),
            # so a saved state would not restore into the model as built: not supported.
            raise UnsupportedModelError(str(model_config.model), f"orbax checkpoints of quantized models "
                                        f"({model_config.quantization}) are not supported; serve the "
                                        "safetensors checkpoint")
        t0 = time.perf_counter()
        model = init_abstract_model(model_config, attn_backend=attn_backend, mesh=mesh,
                                    enable_expert_parallel=enable_expert_parallel)
        restore_orbax(model, str(model_config.model))
        still_abstract = abstract_leaves(model)
        if still_abstract:
            raise MissingWeightsError(str(model_config.model), still_abstract)
        logger.info("restored %s in %.2f s", model_config.model, time.perf_counter() - t0)
        return model


_LOADERS: dict[str, type[BaseModelLoader]] = {
    "safetensors": DefaultModelLoader,
    "gguf": GGUFModelLoader,
    "orbax": OrbaxModelLoader,
}


def get_model_loader(model_config: ModelConfig, load_config: LoadConfig) -> BaseModelLoader:
    fmt = detect_load_format(str(model_config.model), load_config.load_format)
    return _LOADERS[fmt](load_config)


def get_model(model_config: ModelConfig, load_config: LoadConfig, *, attn_backend: Any, mesh: Any = None,
              enable_expert_parallel: bool = False) -> nnx.Module:
    """Load the model of a resolved ``model_config`` (see resolve_model_config).

    ``enable_expert_parallel``: MoE experts whole on each device of the "model" axis."""
    if model_config.hf_config is None or model_config.model is None:
        from jaxlm.model_loader.resolve import resolve_model_config

        model_config = resolve_model_config(model_config, load_config)
    loader = get_model_loader(model_config, load_config)
    return loader.load_model(model_config, attn_backend=attn_backend, mesh=mesh,
                             enable_expert_parallel=enable_expert_parallel)
