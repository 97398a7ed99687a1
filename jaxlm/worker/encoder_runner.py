"""The vision encoder's programs and the encoder cache of a multimodal model's runner.

* Programs: ``model.get_multimodal_embeddings`` (vision tower + projector) compiled at warm-up
  for each image-count bucket (1, 2, 4, ... up to the prompt limit); the image size is fixed by
  the model (CLIP's position embeddings), so serving never compiles. A request's images are
  encoded in one call, padded to the bucket; the program reads only the tower's and the
  projector's parameters.
* Encoder cache: req_id -> the projected rows of each of its images (host float32 [L, hidden]).
  Filled the first time a step holds one of the request's placeholder tokens (a prefix-cache hit
  that covers an image never encodes it), kept while later chunks of the prompt still need rows
  (chunked prefill may split an image's tokens), dropped once the prompt is past its last image,
  or when the request finishes or is preempted (a resumed request is encoded again).
* Each step's body gets ``mm_embeds`` [T, hidden] and ``mm_mask`` [T]: the rows of that step's
  placeholder tokens at their flat positions (step_rows), merged after the token embedding.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.worker.step_programs import leaves_read, with_unread

logger = logging.getLogger(__name__)


def image_buckets(max_images: int) -> list[int]:
    """Powers of two below max_images, then max_images itself."""
    buckets, n = [], 1
    while n < max_images:
        buckets.append(n)
        n *= 2
    return buckets + [max_images] if max_images > 0 else []


class EncoderRunner:
    def __init__(self, model: nnx.Module, graphdef: Any, treedef: Any, max_images: int,
                 replicated: jax.sharding.NamedSharding | None):
        self.graphdef, self.treedef, self.replicated = graphdef, treedef, replicated
        self.hidden_size = int(model.args.hidden_size)
        self._setup(model, max_images)
        self._programs: dict[int, Any] = {}
        self._leaf_index: list[int] = []
        self.cache: dict[str, list[np.ndarray]] = {}
        self._features: dict[str, list[Any]] = {}  # req_id -> its MultiModalFeatureSpecs
        self._zero_rows: dict[int, np.ndarray] = {}
        self.num_encoded = 0  # images run through the encoder (tests: a cache hit encodes none)

    def _setup(self, model: nnx.Module, max_images: int) -> None:
        """The image size and the buckets (a subclass: patch-count buckets)."""
        self.pixel_shape = tuple(model.pixel_shape)
        self.tokens_per_image = int(model.tokens_per_image)
        self.buckets = image_buckets(max_images)

    def _check_feature(self, req_id: str, f: Any) -> None:
        if f.mm_position.length != self.tokens_per_image:
            raise ValueError(f"request {req_id}: an image has {f.mm_position.length} placeholder tokens, the "
                             f"model gives {self.tokens_per_image} rows per image")

    # ---- programs -------------------------------------------------------------------------

    def _fn(self, like: list[Any]) -> Any:
        graphdef, treedef, index = self.graphdef, self.treedef, self._leaf_index

        def encode(read_leaves, *inputs):
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, with_unread(read_leaves, index, like)))
            return model.get_multimodal_embeddings(*inputs).astype(jnp.float32)

        return encode

    def _input_specs(self, n: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The encoder program's inputs for bucket n: the images' pixels."""
        return (jax.ShapeDtypeStruct((n, *self.pixel_shape), jnp.float32, sharding=self.replicated),)

    def compile(self, param_leaves: list[Any]) -> int:
        """Compile one program per bucket; returns how many."""
        if not self.buckets:  # --limit-mm-per-prompt '{"image": 0}': images are refused
            return 0
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in param_leaves]
        treedef, graphdef = self.treedef, self.graphdef

        def embed(leaves, *x):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)).get_multimodal_embeddings(*x)

        self._leaf_index = leaves_read(embed, specs, *self._input_specs(self.buckets[0]))
        read = [specs[i] for i in self._leaf_index]
        for n in self.buckets:
            self._programs[n] = jax.jit(self._fn(specs)).lower(read, *self._input_specs(n)).compile()
        return len(self._programs)

    def _encode(self, param_leaves: list[Any], features: list[Any]) -> list[np.ndarray]:
        start = time.perf_counter()
        n = len(features)
        bucket = next(b for b in self.buckets if b >= n)
        pixels = np.zeros((bucket, *self.pixel_shape), np.float32)
        for i, f in enumerate(features):
            pixels[i] = f.data
        read = [param_leaves[i] for i in self._leaf_index]
        rows = np.asarray(self._programs[bucket](read, pixels))
        self.num_encoded += n
        logger.debug("encoded %d image(s) in %.1f ms", n, 1e3 * (time.perf_counter() - start))
        return [rows[i] for i in range(n)]

    # ---- requests -------------------------------------------------------------------------

    def update(self, so: SchedulerOutput) -> None:
        """Forget finished / preempted requests (their rows too); note the new ones' images."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.cache.pop(req_id, None)
            self._features.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.cache.pop(new.req_id, None)
            if new.mm_features:
                for f in new.mm_features:
                    self._check_feature(new.req_id, f)
                self._features[new.req_id] = list(new.mm_features)
            else:
                self._features.pop(new.req_id, None)

    def step_rows(self, param_leaves: list[Any], inputs: Any, T: int) -> tuple[np.ndarray, np.ndarray]:
        """(mm_embeds [T, hidden] float32, mm_mask [T] int32) of the step's placeholder tokens."""
        mask = np.zeros(T, np.int32)
        if not any(r in self._features for r in inputs.req_ids):
            if T not in self._zero_rows:
                self._zero_rows[T] = np.zeros((T, self.hidden_size), np.float32)
            return self._zero_rows[T], mask
        rows = np.zeros((T, self.hidden_size), np.float32)
        qsl = inputs.query_start_loc
        for i, req_id in enumerate(inputs.req_ids):
            features = self._features.get(req_id)
            if not features:
                continue
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            start = int(inputs.positions[lo])  # the prompt position of the request's first token here
            end = start + hi - lo
            for k, f in enumerate(features):
                a, b = max(start, f.mm_position.offset), min(end, f.mm_position.end)
                if a >= b:
                    continue
                if req_id not in self.cache:
                    self.cache[req_id] = self._encode(param_leaves, features)
                emb = self.cache[req_id][k]
                rows[lo + a - start:lo + b - start] = emb[a - f.mm_position.offset:b - f.mm_position.offset]
                mask[lo + a - start:lo + b - start] = 1
            if end >= features[-1].mm_position.end:  # past its last image: its rows are done
                self.cache.pop(req_id, None)
                self._features.pop(req_id, None)
        return rows, mask

