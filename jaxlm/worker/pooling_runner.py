"""PoolingModelRunner: the pooling runner's device side — the model (no LM head, no KV cache),
one compiled program per (seq_len, rows) bucket, each step's pooled outputs back to the host.

A program runs the model over ``rows x seq_len`` tokens with the dense attention backend
(``attention/dense.py``: bidirectional for encoders, causal for decoders), pools each row
(``pooling/pooler.py``) and applies the model's head. Every program is compiled at start-up
(``.lower().compile()``); serving calls only those, and the compile guard counts any compile
during a step (tests assert 0). One device (tensor/pipeline parallel pooling is not supported).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.attention.dense import DENSE_BACKEND, DenseAttentionMetadata
from jaxlm.config import EngineConfig
from jaxlm.core.pooling_scheduler import PoolingBatch, PoolingBuckets, batch_arrays
from jaxlm.executor.compilation_cache import configure_compilation_cache
from jaxlm.model_loader.loader import get_model
from jaxlm.pooling.pooler import pool_hidden
from jaxlm.worker.compile_guard import CompileGuard

logger = logging.getLogger(__name__)


class PoolingModelRunner:
    def __init__(self, config: EngineConfig, buckets: PoolingBuckets):
        pc = config.parallel_config
        if pc.tensor_parallel_size * pc.pipeline_parallel_size * pc.data_parallel_size != 1:
            raise ValueError("the pooling runner runs on one device: tensor, pipeline and data parallel "
                             "pooling are not supported yet")
        configure_compilation_cache(config.compilation_config)
        self.buckets = buckets
        self.model = get_model(config.model_config, config.load_config, attn_backend=DENSE_BACKEND)
        graphdef, state = nnx.split(self.model)
        self._leaves, treedef = jax.tree.flatten(state)
        self._graphdef, self._treedef = graphdef, treedef
        self.pooling_type: str | None = None  # set_pooling_type, before warmup
        self.programs: dict[tuple[int, int], Any] = {}
        self.guard = CompileGuard()
        self.num_steps = 0

    def set_pooling_type(self, pooling_type: str) -> None:
        """The pooling every program does (before warmup)."""
        graphdef, treedef = self._graphdef, self._treedef
        causal = bool(self.model.causal)
        apply_head = pooling_type != "ALL"
        self.pooling_type = pooling_type

        def forward(leaves, ids, types, lens, seq_len):
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            rows = lens.shape[0]
            positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), rows)
            md = DenseAttentionMetadata(seq_lens=lens, seq_len=seq_len, causal=causal)
            hidden = model.pooling_hidden(ids, positions, types, md).reshape(rows, seq_len, -1)
            pooled = pool_hidden(hidden, lens, pooling_type)
            return model.pooling_head(pooled).astype(jnp.float32) if apply_head else pooled

        self._forward = jax.jit(forward, static_argnums=(4,))

    @property
    def hidden_size(self) -> int:
        return int(self.model.hidden_size)

    @property
    def num_labels(self) -> int | None:
        return self.model.num_labels

    @property
    def num_compiles_after_warmup(self) -> int:
        return self.guard.count

    def warmup(self) -> None:
        """Compile every (seq_len, rows) program (JAX's persistent cache makes a restart cheap)."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self._leaves]
        for L, R in tqdm(self.buckets.programs(), desc="Compiling pooling programs", disable=None, leave=False):
            i32 = jnp.int32
            self.programs[(L, R)] = self._forward.lower(
                leaves, jax.ShapeDtypeStruct((R * L,), i32), jax.ShapeDtypeStruct((R * L,), i32),
                jax.ShapeDtypeStruct((R,), i32), L).compile()
        logger.info("compiled %d pooling programs in %.1f s", len(self.programs), time.perf_counter() - t0)

    def execute(self, batch: PoolingBatch) -> list[np.ndarray]:
        """One step: each request's raw pooled row ([H] / [num_labels]; ALL: [tokens, H])."""
        ids, types, lens = batch_arrays(batch)
        program = self.programs[(batch.seq_len, batch.rows)]
        with self.guard.step():
            out = np.asarray(program(self._leaves, ids, types, lens))
        self.num_steps += 1
        n = len(batch.requests)
        if self.pooling_type == "ALL":
            return [out[i, : lens[i]] for i in range(n)]
        return list(out[:n])
