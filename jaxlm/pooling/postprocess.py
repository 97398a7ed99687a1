"""Per-request finishing of a pooled output on the host (numpy, a few hundred floats a request):
Matryoshka truncation then L2 normalization for embeddings, the classifier's activation
(sigmoid for one label, softmax for several) for classification and scores."""

from __future__ import annotations

import numpy as np

from jaxlm.pooling.resolve import PoolerSpec
from jaxlm.pooling_params import PoolingParams


def _l2_normalize(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norm, 1e-12)  # torch.nn.functional.normalize's eps


def _activation(x: np.ndarray) -> np.ndarray:
    if x.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-x))
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def finish_output(raw: np.ndarray, params: PoolingParams, spec: PoolerSpec, task: str) -> np.ndarray:
    """raw: the program's row ([H], [num_labels] or [tokens, H]) -> what the request gets."""
    x = np.asarray(raw, dtype=np.float32)
    if task == "reward":
        return x
    if spec.has_head:
        activation = spec.activation if params.activation is None else params.activation
        return _activation(x) if activation else x
    dims = params.dimensions if params.dimensions is not None else spec.dimensions
    if dims is not None:
        x = x[..., :dims]
    normalize = spec.normalize if params.normalize is None else params.normalize
    return _l2_normalize(x) if normalize else x
