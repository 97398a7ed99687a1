"""ModelRunner: scheduler output -> padded device inputs -> compiled steps -> sampled tokens.

Programs, all compiled ahead of time at warm-up, so serving only calls compiled executables
and a shape outside the buckets can never trigger a silent compile:
  * body[T, kind]: the model over a flat batch padded to T tokens; writes the paged KV cache
    (donated) and gathers the hidden state of each sampling request's last token into a
    fixed-size [S_cap, H] buffer. A static kind per step:
      - "mixed": any step (prefill, chunked prefill, decode), one per token bucket;
      - "decode": every request has one token (AttentionMetadata.max_query_len = 1, static),
        so a kernel backend runs its decode kernel. Only for the token buckets a decode step
        can reach (up to the one holding max_num_seqs), and only when the attention backend
        has kernels (`constraints()` not None): the XLA backend runs one function for every
        step, so it gets no decode programs;
      - "prompt_logprobs": also the logprobs of every position, run only when a request in
        the step still owes prompt logprobs; the only program that sees every hidden state.
        Compiled for every other token bucket (prompt_logprobs_buckets): it is a second
        compile of the model, for rare steps.
  * sample[S, variant]: logits of the first S rows of that buffer + the sampler, for each of
    the 6 SERVING_VARIANTS (the builder picks the cheapest covering one once per step).
Program count: |token buckets| + |decode buckets| + |prompt-logprobs buckets|
+ 6 x |seq buckets| (a sum, never a product of bucket lists).

Per-request host state lives in RequestStates (worker/request_states.py), shared with the
StepHandles; the compile guard is worker/compile_guard.py; a warm start loads the programs from
worker/program_cache.py (with defer_program_load, each on first use or while the engine idles); a
cold start with compile_in_background compiles some in a thread while it serves (worker/warmup.py).

Structured outputs: each constrained request's matcher (host side) stays until it finishes.
A step dispatches the body, fills the grammar bitmask while the device runs it, dispatches
the sampler, then advances the matchers and reports the requests whose grammar accepts nothing
more (ModelRunnerOutput.grammar_terminated_req_ids).

A lean step (issue 14; docs/ARCHITECTURE.md): the body's int32 inputs and the sampler's
metadata are two packed host buffers, handed to the compiled programs as they are (no
jax.device_put); the programs take the model state's leaves, flattened once at load.
execute_model(so, non_block=True) returns a StepHandle once the step is dispatched (async
scheduling); `step_timer` (benchmarks only) gets a lap at each boundary of the step.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.attention.kv_quant import kv_scale_leaf_index
from jaxlm.config import EngineConfig
from jaxlm.config.speculative import max_sampled_rows
from jaxlm.core.outputs import ModelRunnerOutput
from jaxlm.core.sched_output import SchedulerOutput
from jaxlm.executor.distributed import place_inputs
from jaxlm.lora.layers import install_lora
from jaxlm.lora.slots import LoRASlotManager
from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sample.metadata import SERVING_VARIANTS, HostArrays, SamplerVariant
from jaxlm.sample.sampler import sample
from jaxlm.worker.buckets import (
    PaddingStats, decode_buckets, default_seq_buckets, default_token_buckets, prompt_logprobs_buckets,
    validate_buckets)
from jaxlm.worker.background_compile import BackgroundCompiles, ReadyBuckets
from jaxlm.worker.compile_guard import CompileGuard
from jaxlm.worker.compile_jobs import compile_jobs
from jaxlm.worker.encoder_factory import make_encoder_runner
from jaxlm.worker.input_batch import InputBatch, StepInputs
from jaxlm.worker.kv_cache_alloc import allocate_kv_caches, kv_sharding
from jaxlm.worker.mrope_positions import MRopePositions
from jaxlm.worker.program_cache import DeferredLoads
from jaxlm.worker.release import delete_arrays, reachable_arrays
from jaxlm.worker.request_states import RequestStates
from jaxlm.worker.step_handle import StepHandle
from jaxlm.worker.step_programs import (
    DECODE, MIXED, PROMPT_LOGPROBS, body_program, kernel_constraints, leaves_read, sample_program)
from jaxlm.worker.warmup import warm_up

logger = logging.getLogger(__name__)

class ModelRunner:
    # The sampler inside every sample program (a speculative runner: the rejection sampler).
    sampler_fn = staticmethod(sample)

    def __init__(self, config: EngineConfig, model: nnx.Module, mesh: jax.sharding.Mesh | None = None):
        self.config = config
        self.mesh = mesh
        # Step inputs, sampling metadata, sampled rows: replicated on a mesh (no resharding).
        self._replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                            if mesh is not None and mesh.size > 1 else None)
        self._multiprocess = jax.process_count() > 1
        sched = config.scheduler_config
        self.block_size = config.cache_config.block_size
        self.max_model_len = sched.max_model_len
        self.max_num_seqs = sched.max_num_seqs
        hf_config = config.model_config.hf_config
        # From the model's own args: under tensor parallel they may hold replicated KV heads.
        self.kv_cache_spec = type(model).kv_cache_spec(model.args)
        lora = config.lora_config
        lora_targets = install_lora(model, lora.max_loras, lora.max_lora_rank, mesh) if lora.enable_lora else None
        self.graphdef, self.params = nnx.split(model)
        # Flattened once: the programs take the leaves as a flat list (see the module docstring).
        self._param_leaves, self._param_treedef = jax.tree.flatten(self.params)
        # --calculate-kv-scales: the leaves of the fp8 cache's K/V scales, which every body program
        # also returns (set by the first step that writes tokens, then unchanged: kv_quant.py).
        self._kv_scale_index = kv_scale_leaf_index(self.params) if config.cache_config.calculate_kv_scales else []
        # LoRA: adapter slots on the device, a slot index per token (jaxlm/lora/slots.py).
        self.lora = LoRASlotManager(model, lora_targets, lora, self._param_leaves) if lora_targets else None
        # A multimodal model: the vision encoder's programs and cache (worker/encoder_runner.py).
        self.encoder = None
        if getattr(model, "supports_multimodal", False):
            if config.speculative_config is not None and config.speculative_config.method == "draft_model":
                raise ValueError("a draft model cannot run beside a multimodal target yet (it would not see the "
                                 "images): use speculative method ngram or none")
            self.encoder = make_encoder_runner(model, self.graphdef, self._param_treedef, config.model_config,
                                               self._replicated)
        # Qwen2.5-VL's M-RoPE: [3, T] rope positions beside the body's inputs (worker/mrope_positions.py).
        self.mrope = (MRopePositions(model.vision_args.spatial_merge_size)
                      if getattr(model, "uses_mrope", False) else None)
        self.kernel_constraints = kernel_constraints(model, self.block_size, self.kv_cache_spec.head_dim)
        c = self.kernel_constraints
        comp = config.compilation_config
        budget = sched.max_num_batched_tokens
        spec = config.speculative_config
        tokens = comp.token_buckets or default_token_buckets(budget, spec and 1 + spec.num_speculative_tokens)
        self.token_buckets = validate_buckets(
            [c.round_tokens(t) for t in tokens] if c else tokens, budget, "token")
        # No kernels, no decode flavour: an XLA step is the same program whatever its kind.
        self.decode_buckets = decode_buckets(self.token_buckets, sched.max_num_seqs) if c else []
        self.prompt_logprobs_buckets = prompt_logprobs_buckets(self.token_buckets)
        max_rows = max_sampled_rows(spec, sched.max_num_seqs, budget)  # > max_num_seqs: verify steps
        self.seq_buckets = validate_buckets(comp.seq_buckets or default_seq_buckets(sched.max_num_seqs, max_rows),
                                            max_rows, "sequence" if spec is None else "sequence (1 + k rows a request)")
        # The hidden-state buffer the body hands to the sampler: the largest sequence bucket.
        self.sample_capacity = self.seq_buckets[-1]

        self.vocab_size = int(hf_config.vocab_size)
        # The requests' host state (rows, sampler rows, grammars, prompt logprobs, failures).
        self.states = RequestStates(
            InputBatch(sched.max_num_seqs, sched.max_model_len, self.block_size,
                       page_multiple=c.page_multiple if c else 1),
            SamplingInputBuilder(self.vocab_size, sched.max_model_len, engine_seed=config.model_config.seed,
                                 max_logprobs=config.model_config.max_logprobs, variants=SERVING_VARIANTS,
                                 speculative=spec is not None),
            self.lora)
        self.kv_caches: list[jax.Array] | None = None
        self._body: dict[tuple[int, str], Any] = {}
        self._sample: dict[tuple[int, SamplerVariant], Any] = {}
        self.num_programs = self.programs_from_cache = 0
        self.deferred_loads: DeferredLoads | None = None  # a warm start's programs not loaded yet
        # The buckets a step may use: all, unless a cold start compiles some in the background.
        self.ready = ReadyBuckets(self.body_buckets(), self.seq_buckets, self.sampling.variants())
        self.background: BackgroundCompiles | None = None
        self.warmup_seconds = 0.0
        self.compile_guard = CompileGuard()
        # Padding waste: real vs computed tokens, rows, pages, samples (scripts/bench.py reports it).
        self.padding = PaddingStats()
        # Benchmarks only: an object with mark() and lap(part) (jaxlm/benchmarks/host_overhead.py StepTimer).
        self.step_timer: Any | None = None

    # The request state's parts under the runner's names (the engine, benches and tests use them).
    input_batch = property(lambda self: self.states.input_batch)
    sampling = property(lambda self: self.states.sampling)
    grammars = property(lambda self: self.states.grammars)
    prompt_logprobs = property(lambda self: self.states.prompt_logprobs)

    @property
    def num_compiles_after_warmup(self) -> int:
        """XLA compiles seen while a step ran (must stay 0 after warm-up)."""
        return self.compile_guard.count

    # ---- KV cache -------------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int, dtype: jnp.dtype) -> None:
        self.kv_caches = allocate_kv_caches(self.kv_cache_spec, num_blocks, self.block_size, dtype,
                                            self._kv_sharding(self.kv_cache_spec.num_kv_heads))

    def kv_cache_shards(self) -> int:
        """Devices a KV block is split over (1 unless tensor parallel splits the KV heads)."""
        sharding = self._kv_sharding(self.kv_cache_spec.num_kv_heads)
        return 1 if sharding is None else sharding.mesh.shape["model"] if sharding.spec[3] else 1

    def _kv_sharding(self, num_kv_heads: int) -> jax.sharding.NamedSharding | None:
        return kv_sharding(self.mesh, num_kv_heads)

    def release_device_memory(self) -> int:
        """Engine shutdown: stops a background compile, drops the programs and deletes every
        device buffer the runner reaches (worker/release.py says why delete); the bytes freed."""
        if self.background is not None:
            self.background.stop()
        freed = delete_arrays(reachable_arrays(self))
        self._body, self._sample, self.kv_caches = {}, {}, None
        return freed

    # ---- programs -------------------------------------------------------------------------

    def _rows_for(self, num_tokens_padded: int) -> int:
        # Rows never exceed tokens: rows tied to the token bucket keep one body per bucket.
        return min(num_tokens_padded, self.max_num_seqs)

    def body_buckets(self) -> dict[str, list[int]]:
        """The token buckets each body kind is compiled for."""
        return {MIXED: self.token_buckets, DECODE: self.decode_buckets,
                PROMPT_LOGPROBS: self.prompt_logprobs_buckets}

    def _step_shapes(self, T: int, kind: str) -> dict[str, tuple[int, ...]]:
        """Shapes of the body's packed inputs for token bucket T (input_batch.STEP_FIELDS)."""
        shapes = self.input_batch.step_shapes(T, self._rows_for(T), self.sample_capacity)
        if self.lora is not None:
            shapes["lora_slots"] = (T,)
        if self.encoder is not None:
            shapes["mm_mask"] = (T,)
        if self.mrope is not None:
            shapes["mrope_positions"] = (3, T)
        if kind == PROMPT_LOGPROBS:
            shapes["next_token_ids"] = (T,)
        return shapes

    def _body_fn(self, T: int, kind: str) -> Callable:
        return body_program(self, T, kind)

    def _sample_fn(self, num_rows: int, md: HostArrays) -> Callable:
        return sample_program(self, num_rows, md)

    def _merge_for_sampler(self, params: Any) -> nnx.Module:
        """The model the sampler traces (the pipeline runner adds the other stages' abstract params)."""
        return nnx.merge(self.graphdef, params)

    def _find_sampler_leaves(self, leaves_spec: list[Any], hidden_spec: Any) -> None:
        """Which param leaves the sampler programs read (set before they are traced)."""
        merge, treedef = self._merge_for_sampler, self._param_treedef
        logits = lambda leaves, h: merge(jax.tree.unflatten(treedef, leaves)).compute_logits(h)  # noqa: E731
        self._sampler_leaf_index = leaves_read(logits, leaves_spec, hidden_spec)

    @property
    def _sampler_leaves(self) -> list[Any]:
        return [self._param_leaves[i] for i in self._sampler_leaf_index]

    def warm_up(self) -> None:
        """Compile every program the buckets can ask for (one progress bar), or load them all
        untraced from the program cache; with compile_in_background, some after serving starts
        (worker/warmup.py)."""
        warm_up(self)

    def load_deferred_program(self) -> bool:
        """Loads one program a warm start deferred (the engine calls it while idle); False: none left."""
        return self.deferred_loads is not None and self.deferred_loads.load_next()

    def compile_jobs(self) -> list[Callable[[], None]]:
        """One callable per program: each compiles it and keeps the executable."""
        return compile_jobs(self)

    # ---- one step -------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> ModelRunnerOutput | StepHandle:
        """Run one step. non_block: return once it is dispatched, with a StepHandle whose
        result() waits for the tokens (async scheduling: the next step may be dispatched
        first; its decode rows take their input ids from this step's tokens on the device)."""
        with self.compile_guard.step():
            handle = self._dispatch(so)
            return handle if non_block else handle.result()

    def _body_kind(self, so: SchedulerOutput) -> str:
        if self.prompt_logprobs.owes_any(so.num_scheduled_tokens):
            return PROMPT_LOGPROBS
        if self.decode_buckets and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens):
            return DECODE  # one token per request
        return MIXED

    def _dispatch(self, so: SchedulerOutput) -> StepHandle:
        self.states.update(so)
        if self.encoder is not None:
            self.encoder.update(so)
        if self.mrope is not None:
            self.mrope.update(so)
        if so.total_num_scheduled_tokens == 0:
            return StepHandle(self.states, None)

        if self.step_timer:
            self.step_timer.mark()
        inputs, hidden, prompt_rows, sampling, md_in = self._run_body(so)
        out, placed = self._dispatch_sampler(inputs, hidden, sampling, md_in)
        return self._make_handle(inputs, out, placed, prompt_rows)

    def _make_handle(self, inputs: StepInputs, out: Any, placed: Any, prompt_rows: Any) -> StepHandle:
        return StepHandle(self.states, inputs, out, placed, prompt_rows, self.step_timer)

    def _run_body(self, so: SchedulerOutput) -> tuple[StepInputs, jax.Array, Any, HostArrays | None, Any]:
        """Dispatch the step's body: its inputs, the sampling rows' hidden states, the raw prompt logprob
        rows (or None), the sampler's host metadata and input (the pipeline runner overrides this)."""
        timer = self.step_timer
        kind = self._body_kind(so)
        T, kind = self.ready.body(kind, so.total_num_scheduled_tokens)
        inputs = self.input_batch.prepare_inputs(so, T, self._rows_for(T), self.sample_capacity)
        self._record_padding(inputs, T)
        sampling = self._sampling_inputs(inputs)  # before the body: nothing between the dispatches
        if timer:
            timer.lap("prepare")
        extra, mm = self._lora_inputs(inputs, T), ()
        if self.encoder is not None:
            rows, mask = self.encoder.step_rows(self._param_leaves, inputs, T)
            extra, mm = extra + [mask], (self._place(rows),)
        if self.mrope is not None:
            extra = extra + [self.mrope.step_positions(inputs, T).ravel()]
        body_in, md_in = self._device_inputs(inputs, kind, sampling, extra)
        if timer:
            timer.lap("transfer")
        outs = self._body[(T, kind)](self._param_leaves, self.kv_caches, body_in, self._last_tokens, *mm)
        hidden, self.kv_caches = outs[0], outs[-1]
        if self._kv_scale_index:
            self.keep_kv_scales(outs[-2])
        return inputs, hidden, outs[1] if kind == PROMPT_LOGPROBS else None, sampling, md_in

    def keep_kv_scales(self, scales: list[jax.Array]) -> None:
        """The K/V scales a step returned become the next step's (--calculate-kv-scales)."""
        for i, value in zip(self._kv_scale_index, scales):
            self._param_leaves[i] = value

    def _record_padding(self, inputs: StepInputs, T: int) -> None:
        R, num_rows = self._rows_for(T), len(inputs.req_ids)
        real_pages = int((-(-inputs.seq_lens[:num_rows] // self.block_size)).sum())
        self.padding.record(inputs.num_tokens, T, num_rows, R, real_pages, R * self.input_batch.max_pages)

    def _sampling_inputs(self, inputs: StepInputs) -> HostArrays | None:
        """The step's sampler metadata (host), or None when no request samples."""
        if not inputs.sample_req_ids:
            return None
        S = self.ready.seq(len(inputs.sample_req_ids))
        variant = self.sampling.variant_of(inputs.sample_req_ids)  # once per step
        return self.sampling.build_host(inputs.sample_req_ids, S, variant)

    def _dispatch_sampler(self, inputs: StepInputs, hidden: jax.Array, host_md: HostArrays | None,
                          md_in: jax.Array | None) -> Any:
        """Dispatch the sampler; the sampled rows get placeholder tokens (StepHandle.result fills them)."""
        timer = self.step_timer
        if host_md is None:
            if timer:
                timer.lap("dispatch")
            return None, None
        S = host_md.num_rows
        if md_in is None:  # constrained: the mask is filled while the body runs, then sent
            self.grammars.fill_bitmask(host_md.fields, inputs.sample_req_ids, host_md.spec_rows)
            md_in = self._place(host_md.packed())
        out, self._last_tokens = self._sample[(S, host_md.variant)](self._sampler_leaves, hidden, md_in)
        self.padding.record_samples(inputs.num_sampled_rows, S)
        placed = self.input_batch.append_placeholders(inputs.sample_req_ids)
        self.sampling.count_outputs(inputs.sample_req_ids)
        if timer:
            timer.lap("dispatch")
        return out, placed

    def _device_inputs(self, x: StepInputs, kind: str, host_md: HostArrays | None,
                       extra: list[np.ndarray] = ()) -> tuple[Any, Any]:
        """The body's int32 inputs in one buffer (``extra``: the LoRA token slots) and, unless the
        step is constrained, the sampler's: host buffers the executable's C++ call path copies
        (on CPU 7 us per call, against ~50 us for a jax.device_put of both first)."""
        parts = [x.packed, *extra]
        if kind == PROMPT_LOGPROBS:
            parts.append(self.input_batch.next_token_ids(x))
        packed = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return self._place(packed), self._sampler_input(host_md)

    def _lora_inputs(self, x: StepInputs, T: int) -> list[np.ndarray]:
        """[the adapter slot of each token], the step's adapters loaded into slots first; [] without LoRA."""
        if self.lora is None:
            return []
        slots, failed = self.lora.token_slots(x.req_ids, x.token_to_req, x.num_tokens, T)
        self.states.fail(failed)
        return [slots]

    def _sampler_input(self, host_md: HostArrays | None) -> Any:
        """The sampler's packed metadata, or None (no sampled row, or a mask filled while the body runs)."""
        if host_md is None or host_md.variant.structured:
            return None
        return self._place(host_md.packed())

    def _place(self, host: np.ndarray) -> Any:
        return place_inputs(host, self._replicated) if self._multiprocess else host  # several processes: global

    def _put(self, x: Any) -> Any:
        return place_inputs(x, self._replicated)
