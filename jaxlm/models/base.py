"""What every causal LM shares: construction, the decoder loop, HF-name weight loading,
expected names, Param specs and the KV cache spec.

A family subclasses ``CausalLMBase`` and supplies its ``Args`` (the numbers of the HF config it
needs), ``build`` (its module tree), ``decoder``/``input_embedding`` and ``kv_cache_spec``.
The module tree mirrors the HF checkpoint's names (``model.layers.0.self_attn.q_proj``), so the
HF name of a Param is its nnx path joined with dots. Families whose checkpoint differs (a fused
tensor split over several Params, legacy prefixes) override ``_extra_targets`` and
``canonical_name``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxlm.attention.kv_quant import KVCacheScale, fill_kv_scales, is_kv_scale_name
from jaxlm.core.kv_cache_utils import KVCacheSpec
from jaxlm.model_loader.errors import UnexpectedWeightError, WeightShapeError
from jaxlm.models.layers import LMHead
from jaxlm.models.quantization.base_config import QuantizationConfig
from jaxlm.models.quantization.model_quant import apply_quantization_config, quantizable_layers
from jaxlm.models.utils import (  # noqa: F401  (WeightTarget: re-exported for the families)
    MODEL_AXIS, STAGE_AXIS, WeightTarget, get_param_partition_spec, hf_shape, place, place_block, stage_mesh,
    to_param_layout, unsplittable)

logger = logging.getLogger(__name__)

DEFAULT_SOURCE = "<checkpoint>"


def _path_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


class ModelArgs(Protocol):
    """What the base reads from a family's Args dataclass (frozen, hashable)."""

    vocab_size: int
    num_layers: int
    tie_word_embeddings: bool


def run_decoder_layers(
    layers: Sequence[nnx.Module], x: jax.Array, positions: jax.Array, kv_caches: list[jax.Array], attn_metadata
) -> tuple[jax.Array, list[jax.Array]]:
    """Each layer in turn, each over its own KV cache: ``layer(x, positions, kv_cache, md)``.

    A Python loop, unrolled at trace time: one weight array per layer, no per-step copies
    (lax.scan over stacked weights measured slower on CPU).
    """
    new_caches = []
    for layer, cache in zip(layers, kv_caches):
        x, cache = layer(x, positions, cache, attn_metadata)
        new_caches.append(cache)
    return x, new_caches


class DecoderStack(nnx.Module):
    """A family's decoder as three parts: ``embed`` -> ``decoder_layers()`` -> ``final``.

    ``__call__`` runs them all; a pipeline stage runs a contiguous slice of the layers, the
    first stage also ``embed`` and the last also ``final`` (see ``run_stage``).
    """

    def embed(self, input_ids: jax.Array, positions: jax.Array) -> jax.Array:
        raise NotImplementedError

    def decoder_layers(self) -> Sequence[nnx.Module]:
        raise NotImplementedError

    def final(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def __call__(self, input_ids, positions, kv_caches, md):
        x, kv_caches = run_decoder_layers(self.decoder_layers(), self.embed(input_ids, positions), positions,
                                          kv_caches, md)
        return self.final(x), kv_caches


def run_stage(decoder: DecoderStack, inputs: jax.Array, positions: jax.Array, kv_caches: list[jax.Array], md,
              layers: range, *, first: bool, last: bool) -> tuple[jax.Array, list[jax.Array]]:
    """One pipeline stage: ``layers`` of the decoder over their own ``kv_caches``.

    ``inputs`` are the token ids on the first stage (embedded here), else the previous stage's
    hidden state; the last stage applies the decoder's final part (norm, projection).
    """
    x = decoder.embed(inputs, positions) if first else inputs
    stack = decoder.decoder_layers()
    x, kv_caches = run_decoder_layers([stack[i] for i in layers], x, positions, kv_caches, md)
    return (decoder.final(x) if last else x), kv_caches


def split_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of ``pp`` stages; an uneven split gives the first stages one more."""
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's num_hidden_layers={num_layers}: "
                         "every stage needs at least one layer")
    base, extra = divmod(num_layers, pp)
    sizes = [base + (s < extra) for s in range(pp)]
    starts = np.cumsum([0] + sizes)
    return [range(int(starts[s]), int(starts[s + 1])) for s in range(pp)]


def pipeline_param_stages(model: "CausalLMBase", layer_ranges: list[range]) -> dict[tuple, tuple[int, ...]]:
    """nnx path of every Param -> the stages that hold it (the first is where it is loaded).

    A layer's params live on its stage; the LM head on the last; the token embedding on the
    first (and the last too when tied: it is also the LM head); the other parts of ``embed``
    and ``final`` (norms, position embeddings, projections; small) on the first and the last.
    """
    last = len(layer_ranges) - 1
    stages: dict[tuple, tuple[int, ...]] = {}
    stack = model.decoder().decoder_layers()
    by_id: dict[int, tuple[int, ...]] = {}
    for s, layers in enumerate(layer_ranges):
        for i in layers:
            by_id.update({id(n): (s,) for _, n in nnx.iter_graph(stack[i]) if isinstance(n, nnx.Param)})
    if model.lm_head is not None:
        by_id.update({id(n): (last,) for _, n in nnx.iter_graph(model.lm_head) if isinstance(n, nnx.Param)})
    embedding = (0, last) if model.tie_word_embeddings else (0,)
    by_id.update({id(n): embedding for _, n in nnx.iter_graph(model.input_embedding()) if isinstance(n, nnx.Param)})
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            stages[tuple(path)] = by_id.get(id(node), (0, last))
    return stages


class CausalLMBase(nnx.Module):
    """Base of the families: one constructor, forward, logits, loading, sharding, KV cache spec."""

    # HF names that are buffers, not weights (matched as suffixes of the canonical name).
    _ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # False: a pooling model (models/pooling_adapters.py, bert.py), whose output is hidden states.
    has_lm_head: bool = True

    def __init__(
        self, config: Any, *, dtype: jnp.dtype, attn_backend, rngs: nnx.Rngs, mesh: Mesh | None = None,
        enable_expert_parallel: bool = False,
        max_model_len: int | None = None,
        quant_config: QuantizationConfig | None = None,
    ):
        # Static attributes (hashable, so the graphdef can key a jit cache).
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh
        # MoE families: whole experts per device on the "model" axis instead of split experts.
        self.enable_expert_parallel = bool(enable_expert_parallel)
        # The engine's context length (None: the model's own); longrope picks its factors by it.
        self.max_model_len = max_model_len
        self.attn_backend = attn_backend
        tp = mesh.shape.get(MODEL_AXIS, 1) if mesh is not None else 1
        # A ("stage", "data", "model") mesh: pipeline parallel, one sub-mesh per stage.
        self.pipeline_size = mesh.shape.get(STAGE_AXIS, 1) if mesh is not None else 1
        args = self.make_args(config)
        # The checkpoint's vocabulary; the embedding and LM head hold it padded to a multiple of
        # the tensor-parallel size (split evenly), and the padded logits are sliced off.
        self.vocab_size = int(args.vocab_size)
        padded_vocab = -(-self.vocab_size // tp) * tp
        if padded_vocab != self.vocab_size:
            args = dataclasses.replace(args, vocab_size=padded_vocab)
        self.args = self.args_for_tensor_parallel(args, tp)
        # True when lm_head shares the token embedding (then no lm_head.weight is expected).
        self.tie_word_embeddings = bool(self.args.tie_word_embeddings)
        self.build(config, rngs)
        # The quantization config's methods replace the float ones (models/quantization).
        self.quant_config = quant_config
        if quant_config is not None:
            apply_quantization_config(self, quant_config, rngs)
        if self.tie_word_embeddings or not self.has_lm_head:
            self.lm_head = None
        else:
            self.lm_head = LMHead(self.input_embedding().dim, self.args.vocab_size, dtype=self.dtype, rngs=rngs)
        if padded_vocab != self.vocab_size:
            for head in (self.input_embedding(), self.lm_head):
                if head is not None and not hasattr(head, "weight"):
                    raise ValueError("the vocabulary is padded for tensor parallel, which GGUF blocks do not "
                                     "support: use --quantization none")
                if head is not None:
                    head.weight.set_metadata("hf_pad_rows", padded_vocab - self.vocab_size)
        # Pipeline parallel: contiguous layer ranges, one per stage (static, hashable).
        self.layer_ranges = tuple(split_layers(self.args.num_layers, self.pipeline_size))

    # ----- what a family supplies ------------------------------------------------------
    @classmethod
    def make_args(cls, config: Any) -> ModelArgs:
        """The family's Args dataclass from an HF config."""
        raise NotImplementedError

    @classmethod
    def args_for_tensor_parallel(cls, args: Any, tp: int) -> Any:
        """The Args as the model is built for ``tp`` devices (a family may replicate KV heads)."""
        return args

    def build(self, config: Any, rngs: nnx.Rngs) -> None:
        """Create the module tree (under the HF names) from ``self.args``."""
        raise NotImplementedError

    @classmethod
    def kv_cache_spec(cls, args: Any) -> KVCacheSpec:
        """The paged KV cache the family's attention layers read and write."""
        raise NotImplementedError

    @classmethod
    def get_kv_cache_spec(cls, config: Any) -> KVCacheSpec:
        """KV cache spec of an HF config, without building the model."""
        return cls.kv_cache_spec(cls.make_args(config))

    # ----- forward -----------------------------------------------------------------
    def decoder(self) -> DecoderStack:
        """The stack mapping (input_ids, positions, kv_caches, md) -> (hidden, kv_caches)."""
        raise NotImplementedError

    def input_embedding(self) -> nnx.Module:
        """The token embedding (also the LM head when tied)."""
        raise NotImplementedError

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[jax.Array],
                 attn_metadata) -> tuple[jax.Array, list[jax.Array]]:
        check_cache_layout(kv_caches, self.args.num_layers)
        return self.decoder()(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
        if self.lm_head is None:
            logits = self.input_embedding().attend(hidden_states)
        else:
            logits = self.lm_head(hidden_states)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, :self.vocab_size]  # tensor-parallel padding: never sampled
        return logits

    # ----- names -------------------------------------------------------------------
    def canonical_name(self, name: str) -> str:
        """Map legacy spellings of a checkpoint name onto the one this model uses."""
        return name

    def _extra_targets(self) -> dict[str, WeightTarget]:
        """Checkpoint tensors that do not map 1:1 onto a Param by path."""
        return {}

    def _skip_by_path(self, name: str) -> bool:
        """Params filled by an extra target rather than by their own path name."""
        return False

    def _weight_targets(self) -> dict[str, WeightTarget]:
        # Layers with a quantization method (Linear, the stacked experts) say how their tensors
        # load; every other Param loads from the tensor of its own path name.
        targets: dict[str, WeightTarget] = {}
        owned: set[int] = set()
        for prefix, layer in quantizable_layers(self):
            for name, target in layer.weight_targets(prefix).items():
                owned.update(id(param) for param, _ in target.parts)
                if not self._skip_by_path(name):
                    targets[name] = target
        for path, node in nnx.iter_graph(self):
            if isinstance(node, nnx.Param) and id(node) not in owned:
                name = _path_name(path)
                if self._skip_by_path(name):
                    continue
                targets[name] = WeightTarget(hf_shape(node), [(node, _layout_fn(node))])
        targets.update(self._extra_targets())
        return targets

    def expected_weight_names(self) -> set[str]:
        """HF names a checkpoint must hold (no lm_head.weight when the embedding is tied)."""
        return set(self._weight_targets())

    def _is_ignored(self, name: str) -> bool:
        if self.tie_word_embeddings and name == "lm_head.weight":
            return True  # some tied checkpoints still carry a copy
        return any(name.endswith(s) for s in self._ignored_suffixes)

    # ----- loading -----------------------------------------------------------------
    def load_weights(
        self, weights: Iterable[tuple[str, np.ndarray]], *, source: str = DEFAULT_SOURCE
    ) -> set[str]:
        """Fill Params from (HF name, array) pairs, one tensor at a time, straight onto their
        sharding. Returns the (canonical) HF names consumed, knowingly skipped buffers included."""
        targets = self._weight_targets()
        mesh_of = self.placement_meshes()
        loaded: set[str] = set()
        # An fp8 KV cache's per-layer scales (kv_quant): read here, set once all tensors are seen.
        scale_names = {_path_name(p) for p, n in nnx.iter_graph(self) if isinstance(n, KVCacheScale)}
        scales: dict[str, float] = {}
        for raw_name, array in weights:
            name = self.canonical_name(raw_name)
            if is_kv_scale_name(name):  # a float cache ignores an fp8 checkpoint's scales
                if name in scale_names:
                    scales[name] = float(np.asarray(array, np.float32).reshape(-1)[0])
                loaded.add(name)
                continue
            target = targets.get(name)
            if target is None:
                if self._is_ignored(name):
                    loaded.add(name)
                    continue
                raise UnexpectedWeightError(source, raw_name)
            shape = tuple(np.shape(array))
            if not target.accepts(shape):
                raise WeightShapeError(source, raw_name, target.hf_shape, shape)
            host = np.asarray(array)
            for param, fn in target.parts:
                mesh = mesh_of.get(id(param), self.mesh)
                why = unsplittable(param, mesh)
                if why:  # float layouts are checked with the model's config; quantized groups here
                    raise ValueError(f"{source}: {raw_name} cannot be split for this tensor parallel layout: {why}, "
                                     "which is not a multiple (choose a tensor_parallel_size that divides it)")
                dtype = param.get_value().dtype  # the model dtype, or a quantized format's own
                if target.starts is None:
                    place(param, fn(host), dtype, mesh)
                else:
                    place_block(param, fn(host), target.starts, dtype, mesh)
            loaded.add(name)
            del array, host  # not held while the next tensor is read
        if scale_names:
            fill_kv_scales(self, scales, self.attn_backend.kv_quant, source)
        logger.debug("loaded %d tensors from %s", len(loaded), source)
        return loaded

    # ----- sharding ----------------------------------------------------------------
    def placement_meshes(self) -> dict[int, Mesh]:
        """id(Param) -> the stage sub-mesh it is loaded onto (empty without pipeline parallel)."""
        if self.pipeline_size == 1:
            return {}
        homes = pipeline_param_stages(self, list(self.layer_ranges))
        return {id(node): stage_mesh(self.mesh, homes[tuple(path)][0])
                for path, node in nnx.iter_graph(self) if isinstance(node, nnx.Param)}

    def partition_specs(self) -> dict[str, PartitionSpec]:
        """nnx path name -> PartitionSpec of every Param."""
        return {
            _path_name(path): get_param_partition_spec(node)
            for path, node in nnx.iter_graph(self)
            if isinstance(node, nnx.Param)
        }


def _layout_fn(param: nnx.Variable) -> Callable[[np.ndarray], np.ndarray]:
    return lambda a: to_param_layout(param, a)


def check_cache_layout(kv_caches: list[jax.Array], num_layers: int) -> None:
    if len(kv_caches) != num_layers:
        raise ValueError(f"expected {num_layers} kv caches (one per layer), got {len(kv_caches)}")
