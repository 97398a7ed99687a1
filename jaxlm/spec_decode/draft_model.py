"""The draft model: a second model in the same engine core, proposing k tokens per request.

It is a ModelRunner of its own (its weights, its KV cache, its compiled programs, the compile
guard and warm-up of the target's, on the target's mesh) with the target's bucket geometry, and
its KV cache is indexed by the target's block tables: a block holds the draft's K/V of the same
tokens as the target's (so the draft's cache needs no bookkeeping: the scheduler's blocks,
prefix-cache hits and preemptions serve both). To keep that true, every target step is mirrored:
the draft's body runs on the step's very inputs (same packed buffer, same token bucket), writing
its K/V wherever the target writes its own. Positions the target rolls back are rewritten by the
next step, in both caches.

Proposing, after a step whose tokens are back: for each request with n tokens now, k draft steps
of one token each (positions n - 1 .. n + k - 2; the first feeds its last token, each next one
the previous step's argmax, read on the device through the body's prev_idx input). Greedy drafts
(argmax), as vLLM v1's draft proposers: the rejection sampler treats them as one-hot. Writes past
the blocks the request holds are dropped (the scheduler allocates k lookahead slots for them;
drafts whose positions fall past max_model_len are never scheduled).

Programs: a body per token bucket and a greedy sampler per sequence bucket up to the one holding
max_num_seqs, counted with the target's and compiled under the same progress bar.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlm.config import EngineConfig, LoRAConfig
from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sample.metadata import SamplerVariant
from jaxlm.worker.buckets import pick_bucket
from jaxlm.worker.input_batch import StepInputs
from jaxlm.worker.model_runner import ModelRunner
from jaxlm.worker.step_programs import MIXED

logger = logging.getLogger(__name__)

_GREEDY = SamplerVariant()


class DraftModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, model: nnx.Module, mesh: jax.sharding.Mesh, target: ModelRunner):
        spec = config.speculative_config
        comp = dataclasses.replace(config.compilation_config, token_buckets=list(target.token_buckets),
                                   seq_buckets=list(target.seq_buckets))
        # No adapters on the draft: it only proposes, and the target verifies with the request's adapter.
        draft_config = dataclasses.replace(config, model_config=spec.draft_model_config, compilation_config=comp,
                                           speculative_config=None, lora_config=LoRAConfig())
        super().__init__(draft_config, model, mesh)
        if self.input_batch.max_pages != target.input_batch.max_pages:
            raise ValueError(f"the draft model's attention kernels page its cache in groups of "
                             f"{self.input_batch.max_pages} pages, the target's {target.input_batch.max_pages}")
        self.target = target
        self.k = spec.num_speculative_tokens
        # Another mesh (draft_tensor_parallel_size=1 under a TP target): the target's device
        # tokens cannot feed this body; EngineCore then runs every step synchronously, so no
        # step reads a token that is not on the host yet.
        self.same_mesh = mesh is target.mesh
        self.states.sampling = SamplingInputBuilder(self.vocab_size, self.max_model_len, variants=(_GREEDY,))
        # Proposals sample one row per request (sample_capacity stays the target's: the layout of
        # the packed inputs the mirror shares).
        self.seq_buckets = [b for b in self.seq_buckets if b <= pick_bucket(self.max_num_seqs, self.seq_buckets)]
        self._neutral_md: dict[int, np.ndarray] = {}

    def body_buckets(self) -> dict[str, list[int]]:
        return {MIXED: self.token_buckets}

    def mirror(self, inputs: StepInputs, prev_tokens: Any) -> None:
        """The target's step, on the draft: its K/V written where the target writes its own."""
        T = len(inputs.input_ids)
        prev = prev_tokens if self.same_mesh else self._last_tokens
        outs = self._body[(T, MIXED)](self._param_leaves, self.kv_caches, self._place(inputs.packed), prev)
        self.kv_caches = outs[-1]

    def propose(self, rows: list[int]) -> list[list[int]]:
        """k greedy drafts for each of these input-batch rows (the target's), from its tokens."""
        batch = self.target.input_batch
        rows_a = np.asarray(rows, np.int64)
        R = len(rows)
        T = pick_bucket(R, self.token_buckets)
        S = pick_bucket(R, self.seq_buckets)
        md = self._neutral_md.get(S)
        if md is None:
            md = self._neutral_md[S] = self.sampling.build_host([], S, _GREEDY).packed()
        start = batch.num_tokens[rows_a].astype(np.int64) - 1  # the last known token's position
        tokens, prev = [], self._last_tokens
        for j in range(self.k):
            packed = self._draft_step_inputs(batch, rows_a, start + j, T, j == 0)
            hidden, self.kv_caches = self._body[(T, MIXED)](self._param_leaves, self.kv_caches, self._place(packed), prev)
            out, prev = self._sample[(S, _GREEDY)](self._sampler_leaves, hidden, self._place(md))
            tokens.append(out.sampled_token_ids)
        drafts = np.stack([np.asarray(t)[:R] for t in tokens], axis=1)  # [R, k]
        room = np.clip(self.max_model_len - start - 1, 0, self.k)  # positions past max_model_len
        return [drafts[i, :room[i]].tolist() for i in range(R)]

    def _draft_step_inputs(self, batch: Any, rows: np.ndarray, pos: np.ndarray, T: int, first: bool) -> np.ndarray:
        """The packed body inputs of one draft step: one token per request at pos (its last
        token on the first step, else the previous step's draft on the device)."""
        R, bs, Rp = len(rows), self.block_size, self._rows_for(T)
        size, layout = batch._layout(T, Rp, self.sample_capacity)
        packed = np.zeros(size, np.int32)
        x = {f: packed[a:b].reshape(shape) for f, a, b, shape in layout}
        p = np.minimum(pos, self.max_model_len - 1)
        page = p // bs
        held = page < batch.num_blocks[rows]
        block = batch.block_table[rows, np.minimum(page, batch.max_pages - 1)]
        idx = np.arange(R, dtype=np.int32)
        x["input_ids"][:R] = batch.token_ids[rows, p] if first else 0
        x["positions"][:R] = p
        x["slot_mapping"][:R] = np.where(held & (pos < self.max_model_len), block * bs + p % bs, -1)
        x["slot_mapping"][R:] = -1
        x["token_to_req"][:R] = idx
        x["token_to_req"][R:] = R - 1
        x["prev_idx"][:R] = -1 if first else idx
        x["prev_idx"][R:] = -1
        x["block_tables"][:R] = batch.block_table[rows]
        x["seq_lens"][:R] = p + 1
        x["context_lens"][:R] = p
        x["query_start_loc"][:R + 1] = np.arange(R + 1)
        x["query_start_loc"][R + 1:] = R
        x["logits_indices"][:R] = idx
        return packed

