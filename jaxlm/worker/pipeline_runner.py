"""PipelineModelRunner: the layers in contiguous stages, each stage on its own sub-mesh (MPMD).

The mesh is ("stage", "data", "model"); stage s owns layers ``model.layer_ranges[s]`` (an
uneven split gives the first stages one more), their weights and their KV cache, on the
("data", "model") sub-mesh s (which may itself be tensor parallel). Each stage has its own
compiled programs, one per body bucket, as the one-device body:
  * stage 0: packed step inputs -> embedding + its layers -> hidden state [T, H];
  * stage s: hidden state (copied from stage s-1's devices) -> its layers -> hidden state;
  * last stage: its layers + final norm; writes each sampling row's hidden state into the
    step's [S_cap, H] sample buffer at its row of the step (``sample_dest``).
The samplers run once per step on the last stage, over the buffer every micro-batch wrote.
Program count: pp x (body buckets) + 6 x |seq buckets| (a sum over bucket lists, times pp).

Micro-batches: a step's requests are cut into ``min(pp, requests)`` contiguous groups of
about equal tokens (rows, so each group has its own attention metadata), each padded to its
own token bucket; a step owing prompt logprobs runs as one group. The runner dispatches them
in pipeline order (clock t runs stage s on micro-batch t - s); JAX's async dispatch lets
stage s work on micro-batch m while stage s+1 works on m-1, on different devices.
``last_schedule`` keeps the (stage, micro-batch) dispatch order of the last step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.config import EngineConfig
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.models.base import pipeline_param_stages, run_stage
from jaxlm.models.utils import STAGE_AXIS, stage_mesh
from jaxlm.sample.metadata import HostArrays
from jaxlm.sample.sampler import compute_prompt_logprobs
from jaxlm.worker.buckets import pick_bucket
from jaxlm.worker.input_batch import StepInputs
from jaxlm.worker.model_runner import ModelRunner
from jaxlm.worker.step_programs import DECODE, MD_FIELDS, MIXED, PROMPT_LOGPROBS, gathered, unpack

logger = logging.getLogger(__name__)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def split_micro_batches(num_scheduled_tokens: dict[str, int], num_micro_batches: int) -> list[dict[str, int]]:
    """Contiguous groups of requests (at least one each) of about equal token counts."""
    items = list(num_scheduled_tokens.items())
    M = max(1, min(num_micro_batches, len(items)))
    cum = np.cumsum([n for _, n in items])
    groups, start = [], 0
    for k in range(M):
        if k == M - 1:
            end = len(items)
        else:
            end = int(np.searchsorted(cum, cum[-1] * (k + 1) / M)) + 1
            end = max(start + 1, min(end, len(items) - (M - k - 1)))
        groups.append(dict(items[start:end]))
        start = end
    return groups


class PipelineModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, model: nnx.Module, mesh: jax.sharding.Mesh):
        super().__init__(config, model, mesh)
        self.pp = mesh.shape[STAGE_AXIS]
        self.stage_meshes = [stage_mesh(mesh, s) for s in range(self.pp)]
        self.layer_ranges = list(model.layer_ranges)
        self._stage_replicated = [NamedSharding(m, PartitionSpec()) for m in self.stage_meshes]
        # Sampling runs on the last stage: its metadata and rows live there (base class' name).
        self._replicated = self._stage_replicated[-1]
        self.stage_params, self._abstract_rest = self._split_params(model)
        # The sampler reads the last stage's params (LM head, final norm, tied embedding).
        self.params = self.stage_params[-1]
        self._param_leaves, self._param_treedef = jax.tree.flatten(self.params)
        self._stage_body: list[dict[tuple[int, str], Any]] = [{} for _ in range(self.pp)]
        self._acc0: jax.Array | None = None
        self.num_micro_batches = self.pp
        self.last_schedule: list[tuple[int, int]] = []
        logger.info("pipeline parallel: %d stages, layers %s", self.pp, [(r.start, r.stop) for r in self.layer_ranges])

    def _split_params(self, model: nnx.Module) -> tuple[list[Any], list[Any]]:
        """Per stage: its params (on its sub-mesh; shared ones copied there) and the others,
        abstract (merged into the graph at trace time, never read by that stage)."""
        stages_of = pipeline_param_stages(model, self.layer_ranges)
        flat = list(nnx.to_flat_state(self.params))
        mine, rest = [], []
        for s in range(self.pp):
            here, there = [], []
            for path, var in flat:
                if s not in stages_of[tuple(path)]:
                    there.append((path, var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype))))
                    continue
                value = var.get_value()
                target = NamedSharding(self.stage_meshes[s], value.sharding.spec)
                if value.sharding != target:  # held by two stages: this one's copy
                    value = jax.device_put(value, target)
                here.append((path, var.replace(value)))
            mine.append(nnx.from_flat_state(here))
            rest.append(nnx.from_flat_state(there))
        return mine, rest

    # ---- KV cache: each layer's on its stage's devices ----------------------------------------

    def initialize_kv_cache(self, num_blocks: int, dtype: jnp.dtype) -> None:
        spec = self.kv_cache_spec
        shape = (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        heads = self._kv_sharding(spec.num_kv_heads).spec  # split over KV heads as without stages
        self.kv_caches = [jnp.zeros(shape, dtype, device=NamedSharding(self.stage_meshes[s], heads))
                          for s, layers in enumerate(self.layer_ranges) for _ in layers]
        logger.info("KV cache: %d blocks x %d tokens, %d layers over %d stages, %s",
                    num_blocks, self.block_size, spec.num_layers, self.pp, dtype)

    def kv_cache_shards(self) -> int:
        """Devices a KV block is spread over, rounded down: the busiest stage's devices hold
        ``max stage layers / num_layers`` of it, split over the tensor-parallel size."""
        tp = super().kv_cache_shards()
        return max(1, tp * self.kv_cache_spec.num_layers // max(map(len, self.layer_ranges)))

    def _stage_kv(self, s: int) -> list[jax.Array]:
        return self.kv_caches[self.layer_ranges[s].start:self.layer_ranges[s].stop]

    # ---- programs -----------------------------------------------------------------------------

    def _pipeline_shapes(self, T: int, kind: str) -> dict[str, tuple[int, ...]]:
        # The base body's packed inputs + where each sampling row goes in the step's buffer.
        return {**self._step_shapes(T, kind), "sample_dest": (self.sample_capacity,)}

    def _stage_fn(self, s: int, T: int, kind: str) -> Callable:
        graphdef, rest, layers = self.graphdef, self._abstract_rest[s], self.layer_ranges[s]
        first, last = s == 0, s == self.pp - 1
        replicated, k = self._stage_replicated[s], self.sampling.max_logprobs
        shapes = self._pipeline_shapes(T, kind)

        def stage(params, kv_caches, packed, *carry):
            x = unpack(packed, shapes)
            md = AttentionMetadata(**{f: x[f] for f in MD_FIELDS}, max_query_len=1 if kind == DECODE else None)
            model = nnx.merge(graphdef, params, rest)
            inputs = x["input_ids"] if first else carry[0]
            hidden, kv_caches = run_stage(model.decoder(), inputs, md.positions, kv_caches, md, layers,
                                          first=first, last=last)
            if not last:
                return jax.lax.with_sharding_constraint(hidden, replicated), kv_caches
            acc = carry[1].at[x["sample_dest"]].set(hidden[x["logits_indices"]], mode="drop")
            acc = jax.lax.with_sharding_constraint(acc, replicated)
            if kind != PROMPT_LOGPROBS:
                return acc, kv_caches
            logits = gathered(model.compute_logits(hidden), replicated)
            return acc, compute_prompt_logprobs(logits, x["next_token_ids"], k), kv_caches

        return stage

    def _merge_for_sampler(self, params: Any) -> nnx.Module:
        return nnx.merge(self.graphdef, params, self._abstract_rest[-1])

    def warm_up(self) -> None:
        """Compile every stage's programs for every body bucket, and the samplers, ahead of serving."""
        start = time.perf_counter()
        params = [_abstract(p) for p in self.stage_params]
        kv = [_abstract(self._stage_kv(s)) for s in range(self.pp)]

        def packed(s: int, T: int, kind: str) -> jax.ShapeDtypeStruct:
            size = sum(math.prod(shape) for shape in self._pipeline_shapes(T, kind).values())
            return jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self._stage_replicated[s])

        T0 = self.token_buckets[0]
        x0, _ = jax.eval_shape(self._stage_fn(0, T0, MIXED), params[0], kv[0], packed(0, T0, MIXED))
        hidden_size, dtype = x0.shape[1], x0.dtype
        self._acc0 = jnp.zeros((self.sample_capacity, hidden_size), dtype, device=self._replicated)
        self._last_tokens = self._put(np.zeros(self.sample_capacity, np.int32))  # unused: no async steps
        acc, leaves = _abstract(self._acc0), _abstract(self._param_leaves)
        self._find_sampler_leaves(leaves, acc)
        leaves = [leaves[i] for i in self._sampler_leaf_index]
        jobs = [(s, T, kind) for s in range(self.pp) for kind, buckets in self.body_buckets().items() for T in buckets]
        jobs += [(None, S, v) for S in self.seq_buckets for v in self.sampling.variants()]
        for s, key, kind in tqdm(jobs, desc="Compiling pipeline stages", unit="program"):
            if s is None:
                md = self.sampling.build_host([], key, kind)
                md_spec = jax.ShapeDtypeStruct(md.packed().shape, jnp.int32, sharding=self._replicated)
                self._sample[(key, kind)] = jax.jit(self._sample_fn(key, md)).lower(leaves, acc, md_spec).compile()
                continue
            args = [params[s], kv[s], packed(s, key, kind)]
            if s > 0:
                args.append(jax.ShapeDtypeStruct((key, hidden_size), dtype, sharding=self._stage_replicated[s]))
            if s == self.pp - 1:
                args.append(acc)
            fn = jax.jit(self._stage_fn(s, key, kind), donate_argnums=(1,))
            self._stage_body[s][(key, kind)] = fn.lower(*args).compile()
        self.num_programs = sum(map(len, self._stage_body)) + len(self._sample)
        self.warmup_seconds = time.perf_counter() - start
        logger.info("Compiled %d programs (%d stages) in %.1f s", self.num_programs, self.pp, self.warmup_seconds)

    # ---- one step -----------------------------------------------------------------------------

    def _micro_batch(self, so: SchedulerOutput, group: dict[str, int], kind: str, offset: int) -> tuple:
        sub = dataclasses.replace(so, num_scheduled_tokens=group, total_num_scheduled_tokens=sum(group.values()))
        T = pick_bucket(sub.total_num_scheduled_tokens, self.body_buckets()[kind])
        inputs = self.input_batch.prepare_inputs(sub, T, self._rows_for(T), self.sample_capacity)
        self._record_padding(inputs, T)
        n = len(inputs.sample_req_ids)
        dest = np.full(self.sample_capacity, self.sample_capacity, np.int32)  # out of range: dropped
        dest[:n] = offset + np.arange(n, dtype=np.int32)
        extra = [self.input_batch.next_token_ids(inputs)] if kind == PROMPT_LOGPROBS else []
        packed = np.concatenate([inputs.packed, *extra, dest])
        # Every stage's copy sent before any stage is dispatched: one small transfer per stage.
        return T, inputs, [jax.device_put(packed, rep) for rep in self._stage_replicated]

    def _run_body(self, so: SchedulerOutput) -> tuple[StepInputs, jax.Array, Any, HostArrays | None, Any]:
        kind = self._body_kind(so)
        groups = split_micro_batches(so.num_scheduled_tokens, 1 if kind == PROMPT_LOGPROBS else self.num_micro_batches)
        batches, offset = [], 0
        for group in groups:
            batches.append(self._micro_batch(so, group, kind, offset))
            offset += len(batches[-1][1].sample_req_ids)
        # The whole step as the sampler and the output see it (a prompt-logprobs step is one group).
        step = dataclasses.replace(batches[0][1], req_ids=[r for b in batches for r in b[1].req_ids],
                                   sample_req_ids=[r for b in batches for r in b[1].sample_req_ids])
        sampling = self._sampling_inputs(step)  # before the stages: nothing between the dispatches
        M, last = len(batches), self.pp - 1
        carry: list[Any] = [None] * M
        acc, prompt_rows, schedule = self._acc0, None, []
        for t in range(M + last):  # pipeline order: clock t runs stage s on micro-batch t - s
            for s in range(max(0, t - M + 1), min(t, last) + 1):
                m = t - s
                T, _, packed = batches[m]
                args = [self.stage_params[s], self._stage_kv(s), packed[s]]
                if s > 0:
                    args.append(jax.device_put(carry[m], self._stage_replicated[s]))  # stage s-1 -> s devices
                if s == last:
                    args.append(acc)
                outs = self._stage_body[s][(T, kind)](*args)
                r = self.layer_ranges[s]
                self.kv_caches[r.start:r.stop] = outs[-1]
                if s == last:
                    acc, carry[m] = outs[0], None
                    prompt_rows = outs[1] if kind == PROMPT_LOGPROBS else None
                else:
                    carry[m] = outs[0]
                schedule.append((s, m))
        self.last_schedule = schedule
        return step, acc, prompt_rows, sampling, self._sampler_input(sampling)
