"""ModelRunner: scheduler output -> padded device inputs -> compiled steps -> sampled tokens.

Three kinds of compiled programs, so their count is a sum of bucket list lengths:
  * body[T]: the model over a flat batch padded to T tokens; writes the paged KV cache
    (donated) and gathers the hidden state of each sampling request's last token into a
    fixed-size [S_cap, H] buffer;
  * sample[S, variant]: logits of the first S rows of that buffer + the sampler;
  * prompt_logprobs[T]: logits + logprobs of every position (only run when asked for).
Every program is compiled ahead of time at warm-up; serving only calls compiled executables,
so a shape outside the buckets can never trigger a silent compile.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxlm.attention.metadata import AttentionMetadata
from jaxlm.config import EngineConfig
from jaxlm.core.outputs import LogprobsLists, ModelRunnerOutput
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sample.metadata import SamplerVariant
from jaxlm.sample.sampler import compute_prompt_logprobs, sample
from jaxlm.worker.buckets import (PaddingStats, default_seq_buckets, default_token_buckets, pick_bucket,
                                 validate_buckets)
from jaxlm.worker.input_batch import InputBatch, StepInputs

logger = logging.getLogger(__name__)

# The sampler programs compiled per sequence bucket: a batch runs the cheapest one that covers
# what it needs (the extra parts are neutral for rows that don't use them), so the count stays
# 5 per bucket instead of every combination of the sampler's flags.
_GREEDY = SamplerVariant()
_GREEDY_LOGPROBS = SamplerVariant(logprobs=True)
_RANDOM = SamplerVariant(random=True)
_RANDOM_FILTERED = SamplerVariant(random=True, filters=True)
_FULL = SamplerVariant(*([True] * len(SamplerVariant._fields)))
RUNNER_VARIANTS = (_GREEDY, _GREEDY_LOGPROBS, _RANDOM, _RANDOM_FILTERED, _FULL)


def _cover(need: SamplerVariant) -> SamplerVariant:
    if need.processors or (need.logprobs and need.random):
        return _FULL
    if need.logprobs:
        return _GREEDY_LOGPROBS
    if need.random:
        return _RANDOM_FILTERED if need.filters else _RANDOM
    return _GREEDY


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _register_compile_listener(runner: "ModelRunner") -> None:
    ref = weakref.ref(runner)

    def on_event(name: str, duration: float, **_: Any) -> None:
        r = ref()
        if r is None:
            jax.monitoring.unregister_event_duration_listener(on_event)
        elif name == _COMPILE_EVENT and r._in_step:
            r.num_compiles_after_warmup += 1
            logger.warning("XLA compiled a program while serving (%.2f s): a shape escaped the buckets", duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nnx.Module, mesh: jax.sharding.Mesh | None = None):
        self.config = config
        self.mesh = mesh
        sched = config.scheduler_config
        self.block_size = config.cache_config.block_size
        self.max_model_len = sched.max_model_len
        self.max_num_seqs = sched.max_num_seqs
        comp = config.compilation_config
        budget = sched.max_num_batched_tokens
        self.token_buckets = validate_buckets(
            comp.token_buckets or default_token_buckets(budget), budget, "token")
        self.seq_buckets = validate_buckets(
            comp.seq_buckets or default_seq_buckets(sched.max_num_seqs), sched.max_num_seqs, "sequence")
        # The hidden-state buffer the body hands to the sampler: the largest sequence bucket.
        self.sample_capacity = self.seq_buckets[-1]

        self.graphdef, self.params = nnx.split(model)
        hf_config = config.model_config.hf_config
        self.kv_cache_spec = type(model).get_kv_cache_spec(hf_config)
        self.vocab_size = int(hf_config.vocab_size)
        self.input_batch = InputBatch(sched.max_num_seqs, sched.max_model_len, self.block_size)
        self.sampling = SamplingInputBuilder(
            self.vocab_size, sched.max_model_len, engine_seed=config.model_config.seed)
        self.kv_caches: list[jax.Array] | None = None
        self._body: dict[int, Any] = {}
        self._prompt_lp: dict[int, Any] = {}
        # req_id -> prompt_logprobs asked for, while its prompt is being computed.
        self._prompt_lp_reqs: dict[str, int] = {}
        self._sample: dict[tuple[int, Any], Any] = {}
        self.num_programs = 0
        self.warmup_seconds = 0.0
        # Guard: XLA compiles seen while a step runs (must stay 0 after warm-up).
        self.num_compiles_after_warmup = 0
        # Padding waste: real vs padded tokens over all steps (scripts/bench.py reports it).
        self.num_real_tokens = 0
        self.num_padded_tokens = 0
        self.padding = PaddingStats()
        self._in_step = False
        _register_compile_listener(self)

    # ---- KV cache -------------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int, dtype: jnp.dtype) -> None:
        spec = self.kv_cache_spec
        shape = (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        sharding = self._kv_sharding(spec.num_kv_heads)
        self.kv_caches = [jnp.zeros(shape, dtype, device=sharding) for _ in range(spec.num_layers)]
        logger.info("KV cache: %d blocks x %d tokens, %d layers, %s",
                    num_blocks, self.block_size, spec.num_layers, dtype)

    def _kv_sharding(self, num_kv_heads: int):
        if self.mesh is None:
            return None
        tp = self.mesh.shape.get("model", 1)
        spec = jax.sharding.PartitionSpec(None, None, None, "model" if num_kv_heads % tp == 0 and tp > 1 else None)
        return jax.sharding.NamedSharding(self.mesh, spec)

    # ---- programs -------------------------------------------------------------------------

    def _rows_for(self, num_tokens_padded: int) -> int:
        # Every scheduled request has >= 1 token, so rows never exceed tokens: tying the row
        # padding to the token bucket keeps the body's program count = len(token_buckets).
        return min(num_tokens_padded, self.max_num_seqs)

    def _body_fn(self) -> Callable:
        graphdef = self.graphdef

        def body(params, kv_caches, input_ids, positions, md, logits_indices):
            model = nnx.merge(graphdef, params)
            hidden, kv_caches = model(input_ids, positions, kv_caches, md)
            return hidden[logits_indices], hidden, kv_caches

        return body

    def _sample_fn(self, num_rows: int) -> Callable:
        graphdef = self.graphdef

        def logits_and_sample(params, hidden, sampling_md):
            model = nnx.merge(graphdef, params)
            logits = model.compute_logits(hidden[:num_rows])
            return sample(logits, sampling_md)

        return logits_and_sample

    def _prompt_logprobs_fn(self) -> Callable:
        graphdef, k = self.graphdef, self.sampling.max_logprobs

        def prompt_logprobs(params, hidden, next_token_ids):
            model = nnx.merge(graphdef, params)
            return compute_prompt_logprobs(model.compute_logits(hidden), next_token_ids, k)

        return prompt_logprobs

    def _abstract_step_inputs(self, T: int):
        R = self._rows_for(T)
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        md = AttentionMetadata(
            positions=i32(T), slot_mapping=i32(T), token_to_req=i32(T),
            block_tables=i32(R, self.input_batch.max_pages), seq_lens=i32(R),
            context_lens=i32(R), query_start_loc=i32(R + 1),
        )
        return i32(T), i32(T), md, i32(self.sample_capacity)

    def warm_up(self) -> None:
        """Compile every program the buckets can ask for, ahead of serving."""
        start = time.perf_counter()
        spec = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        kv_spec, params_spec = spec(self.kv_caches), spec(self.params)
        body_jit = jax.jit(self._body_fn(), donate_argnums=(1,))
        hidden_sel, hidden_all, _ = jax.eval_shape(
            body_jit, params_spec, kv_spec, *self._abstract_step_inputs(self.token_buckets[0]))
        jobs = [("body", T, None) for T in self.token_buckets]
        jobs += [("prompt_logprobs", T, None) for T in self.token_buckets]
        jobs += [("sample", S, v) for S in self.seq_buckets for v in RUNNER_VARIANTS]
        for kind, size, variant in tqdm(jobs, desc="Compiling buckets", unit="program"):
            if kind == "body":
                self._body[size] = body_jit.lower(params_spec, kv_spec, *self._abstract_step_inputs(size)).compile()
            elif kind == "prompt_logprobs":
                hidden = jax.ShapeDtypeStruct((size, hidden_all.shape[1]), hidden_all.dtype)
                ids = jax.ShapeDtypeStruct((size,), jnp.int32)
                self._prompt_lp[size] = jax.jit(self._prompt_logprobs_fn()).lower(params_spec, hidden, ids).compile()
            else:
                md_spec = self.sampling.dummy_metadata(size, variant)
                fn = jax.jit(self._sample_fn(size))
                self._sample[(size, variant)] = fn.lower(params_spec, hidden_sel, md_spec).compile()
        self.num_programs = len(self._body) + len(self._prompt_lp) + len(self._sample)
        self.warmup_seconds = time.perf_counter() - start
        logger.info("Compiled %d programs in %.1f s", self.num_programs, self.warmup_seconds)

    # ---- one step -------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._in_step = True
        try:
            return self._execute_model(so)
        finally:
            self._in_step = False

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in self.input_batch.update_states(so):
            self.sampling.remove_request(req_id)
            self._prompt_lp_reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.sampling.remove_request(new.req_id)
            self.sampling.add_request(new.req_id, new.sampling_params, new.prompt_token_ids, new.output_token_ids)
            if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids:
                self._prompt_lp_reqs[new.req_id] = new.sampling_params.prompt_logprobs
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()

        T = pick_bucket(so.total_num_scheduled_tokens, self.token_buckets)
        inputs = self.input_batch.prepare_inputs(so, T, self._rows_for(T), self.sample_capacity)
        self.num_real_tokens += inputs.num_tokens
        self.num_padded_tokens += T
        R = self._rows_for(T)
        self.padding.record(inputs.num_tokens, T, len(inputs.req_ids), R,
                            int((-(-inputs.seq_lens[: len(inputs.req_ids)] // self.block_size)).sum()),
                            R * self.input_batch.max_pages)
        hidden, hidden_all, self.kv_caches = self._body[T](
            self.params, self.kv_caches, *self._device_inputs(inputs))
        prompt_logprobs = self._prompt_logprobs(inputs, hidden_all, T) if self._prompt_lp_reqs else {}

        sampled: dict[str, int] = {}
        logprobs = None
        if inputs.sample_req_ids:
            S = pick_bucket(len(inputs.sample_req_ids), self.seq_buckets)
            variant = _cover(self.sampling.variant_of(inputs.sample_req_ids))
            md = self.sampling.build(inputs.sample_req_ids, S, min_variant=variant)
            out = self._sample[(S, variant)](self.params, hidden, md)
            n = len(inputs.sample_req_ids)
            self.padding.record_samples(n, S)
            token_ids = np.asarray(out.sampled_token_ids)[:n].tolist()
            for req_id, tok in zip(inputs.sample_req_ids, token_ids):
                sampled[req_id] = tok
                self.input_batch.append_token(self.input_batch.req_id_to_row[req_id], tok)
                self.sampling.append_output(req_id, tok)
            if out.logprob_token_ids is not None:
                logprobs = self._logprobs_rows(inputs, out, n)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            req_id_to_index={r: i for i, r in enumerate(inputs.req_ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in inputs.req_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(self, inputs: StepInputs, hidden_all: jax.Array, T: int) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt tokens computed this step (position p predicts token p + 1)."""
        batch = self.input_batch
        wanted = [(i, r) for i, r in enumerate(inputs.req_ids) if r in self._prompt_lp_reqs]
        if not wanted:
            return {}
        rows = np.array([batch.req_id_to_row[r] for r in inputs.req_ids])[inputs.token_to_req[: inputs.num_tokens]]
        next_pos = np.minimum(inputs.positions[: inputs.num_tokens] + 1, batch.max_model_len - 1)
        next_ids = np.zeros(T, np.int32)
        next_ids[: inputs.num_tokens] = batch.token_ids[rows, next_pos]
        ids, lps, ranks = (np.asarray(a) for a in self._prompt_lp[T](self.params, hidden_all, jax.device_put(next_ids)))
        out = {}
        for i, req_id in wanted:
            start, stop = inputs.query_start_loc[i], inputs.query_start_loc[i + 1]
            row = batch.req_id_to_row[req_id]
            first_pos = inputs.positions[start]
            # Only positions whose next token is still part of the prompt.
            n = max(0, min(stop - start, batch.num_prompt_tokens[row] - 1 - first_pos))
            out[req_id] = LogprobsLists(ids[start:start + n], lps[start:start + n], ranks[start:start + n])
            if first_pos + (stop - start) >= batch.num_prompt_tokens[row]:
                del self._prompt_lp_reqs[req_id]  # the prompt is done
        return out

    @staticmethod
    def _logprobs_rows(inputs: StepInputs, out: Any, n: int) -> LogprobsLists:
        """Sampler rows -> rows aligned with inputs.req_ids (zeros where nothing was sampled)."""
        ids, lps, ranks = (np.asarray(a)[:n] for a in (out.logprob_token_ids, out.logprobs, out.sampled_token_ranks))
        pos = {r: i for i, r in enumerate(inputs.req_ids)}
        where = np.array([pos[r] for r in inputs.sample_req_ids])
        full = lambda a: np.zeros((len(inputs.req_ids),) + a.shape[1:], a.dtype)  # noqa: E731
        all_ids, all_lps, all_ranks = full(ids), full(lps), full(ranks)
        all_ids[where], all_lps[where], all_ranks[where] = ids, lps, ranks
        return LogprobsLists(token_ids=all_ids, logprobs=all_lps, ranks=all_ranks)

    def _device_inputs(self, x: StepInputs):
        md = AttentionMetadata(
            positions=x.positions, slot_mapping=x.slot_mapping, token_to_req=x.token_to_req,
            block_tables=x.block_tables, seq_lens=x.seq_lens, context_lens=x.context_lens,
            query_start_loc=x.query_start_loc,
        )
        return jax.device_put((x.input_ids, x.positions, md, x.logits_indices))
