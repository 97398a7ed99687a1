"""Building blocks shared by the model families: linears stored [in, out], embeddings, norms.

Weights are stored in the layout the step multiplies with ([in, out]), so the jitted step
never transposes a weight; the HF [out, in] layout is converted once at load time.
"""

from __future__ import annotations

import enum
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.quantization.base_config import LinearMethodBase
from jaxlm.models.quantization.unquantized import UnquantizedEmbeddingMethod, UnquantizedLinearMethod
from jaxlm.models.utils import (
    HF_AS_IS, HF_TRANSPOSE, MODEL_AXIS, WeightTarget, hf_shape, make_param, to_param_layout)

class ParallelStyle(enum.Enum):
    """How a Linear's weight [in, out] is split over the mesh's "model" axis (tensor parallel).

    vLLM's ColumnParallelLinear / RowParallelLinear / ReplicatedLinear as one flag.
    """

    COLUMN = (None, MODEL_AXIS), (MODEL_AXIS,)  # output features split; bias split with them
    ROW = (MODEL_AXIS, None), (None,)  # input features split (one reduction after); bias whole
    REPLICATED = (None, None), (None,)

    @property
    def weight_spec(self) -> tuple[str | None, ...]:
        return self.value[0]

    @property
    def bias_spec(self) -> tuple[str | None, ...]:
        return self.value[1]


class Linear(nnx.Module):
    """y = x @ W (+ b), W [in, out]. ``hf_layout`` says how the checkpoint stores W.

    The weight's bytes and product belong to the layer's ``quant_method`` (float weights:
    ``UnquantizedLinearMethod``; a quantization config swaps in its own method after the model
    is built, ``models/quantization``). ``quantizable=False`` keeps a layer float whatever the
    config (vLLM builds MoE routers without a quant config). ``lora``: the LoRA adapters' slots
    (jaxlm/lora/layers.py), installed after loading when the engine serves adapters; they add
    their delta around the method's product.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        parallel: ParallelStyle,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        hf_layout: str = HF_TRANSPOSE,
        kv_repeat: tuple[int, int] | None = None,
        quantizable: bool = True,
    ):
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.parallel = ParallelStyle(parallel)
        self.hf_layout = hf_layout
        self.kv_repeat = kv_repeat
        self.dtype = jnp.dtype(dtype)
        self.quantizable = bool(quantizable)
        self.quant_method: LinearMethodBase = UnquantizedLinearMethod()
        self.quant_method.create_weights(self, rngs)
        self.bias = (
            make_param(rngs, (out_features,), dtype, self.parallel.bias_spec, init="zeros", kv_repeat=kv_repeat)
            if bias else None
        )
        self.lora = nnx.data(None)

    def set_quant_method(self, method: LinearMethodBase, rngs: nnx.Rngs) -> None:
        """Replace the weights with ``method``'s (the model is still abstract)."""
        self.quant_method.remove_weights(self)
        self.quant_method = method
        method.create_weights(self, rngs)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """Checkpoint name -> where it loads, for the method's tensors and the bias."""
        targets = self.quant_method.weight_targets(self, prefix)
        if self.bias is not None:
            bias = self.bias
            targets[f"{prefix}.bias"] = WeightTarget(hf_shape(bias), [(bias, lambda a: to_param_layout(bias, a))])
        return targets

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.lora is None:
            y = self.quant_method.apply(self, x)
        else:
            y = self.lora(x, lambda: self.quant_method.apply(self, x))
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    """Token (or position) embedding [num, dim], split over the vocab on "model".

    Its table and the tied LM head's product belong to ``quant_method`` (float:
    ``UnquantizedEmbeddingMethod``; GGUF blocks: ``models/quantization/gguf.py``)."""

    def __init__(self, num: int, dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs, shard_vocab: bool = True):
        self.num, self.dim = int(num), int(dim)
        self.dtype = jnp.dtype(dtype)
        self.shard_vocab = bool(shard_vocab)
        self.quant_method = UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(self, rngs)

    def set_quant_method(self, method, rngs: nnx.Rngs) -> None:
        """Replace the table with ``method``'s (the model is still abstract)."""
        self.quant_method.remove_weights(self)
        self.quant_method = method
        method.create_weights(self, rngs)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return self.quant_method.weight_targets(self, prefix)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.quant_method.embedding(self, ids)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [N, dim] -> [N, num] float32."""
        return self.quant_method.attend(self, x)


class RMSNorm(nnx.Module):
    """RMSNorm; ``weight_offset=1`` is Gemma's norm, which scales by (1 + weight)."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, rngs: nnx.Rngs, weight_offset: float = 0.0):
        self.eps = float(eps)
        self.weight_offset = float(weight_offset)
        self.weight = make_param(rngs, (dim,), dtype, (None,), init="zeros" if weight_offset else "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 as HF does, whatever the model dtype.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.weight_offset:
            # Gemma scales in float32 and casts once at the end (HF's Gemma3RMSNorm).
            return (xf * (self.weight_offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(
        self, dim: int, *, eps: float, dtype: jnp.dtype, rngs: nnx.Rngs, affine: bool = True, bias: bool = True
    ):
        self.eps = float(eps)
        self.weight = make_param(rngs, (dim,), dtype, (None,), init="ones") if affine else None
        self.bias = make_param(rngs, (dim,), dtype, (None,), init="zeros") if affine and bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        if self.weight is not None:
            y = y * self.weight[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class LMHead(nnx.Module):
    """Untied LM head stored [hidden, vocab] (HF stores [vocab, hidden]), vocab split on "model"."""

    def __init__(self, hidden: int, vocab: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = make_param(rngs, (hidden, vocab), dtype, (None, MODEL_AXIS), hf_layout=HF_TRANSPOSE)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.matmul(x, self.weight[...], preferred_element_type=jnp.float32)


def _gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


def _gelu_exact(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


def _quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)  # CLIP's activation


# HF hidden_act / activation_function names.
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": _gelu_exact,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": _quick_gelu,
}


def get_act_fn(name: str) -> Callable[[jax.Array], jax.Array]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"Unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}") from None
