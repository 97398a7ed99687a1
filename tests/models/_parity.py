"""HF-parity driver shared by the family tests: load, prefill several prompts in one flat
ragged step, decode greedily over the paged cache, and compare with transformers."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from jaxlm.attention.backends import get_attention_backend
from jaxlm.models import get_model_architecture
from tests.helpers.paged_batch import PagedBatchBuilder, make_kv_caches
from tests.helpers.tiny_models import load_hf_model

logger = logging.getLogger(__name__)

TOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 128
PAGES_PER_SEQ = 24  # 96 tokens per sequence


def build_model(path: str, dtype=jnp.float32):
    """Abstract model (no memory) + load_weights from the safetensors file, as the loader does."""
    config = transformers.AutoConfig.from_pretrained(path)
    cls = get_model_architecture(config)
    model = nnx.eval_shape(
        lambda: cls(config, dtype=dtype, attn_backend=get_attention_backend("xla"), rngs=nnx.Rngs(0))
    )
    weights = load_file(os.path.join(path, "model.safetensors"))
    loaded = model.load_weights(iter(weights.items()))
    missing = model.expected_weight_names() - loaded
    assert not missing, f"missing weights: {sorted(missing)}"
    return model, config, cls


class JaxRunner:
    """Jitted step (model body + logits at chosen rows) over the model's split state."""

    def __init__(self, model, config, cls):
        self.graphdef, self.state = nnx.split(model)
        self.config = config
        self.caches = make_kv_caches(cls.get_kv_cache_spec(config), NUM_BLOCKS, BLOCK_SIZE)
        self.pb = PagedBatchBuilder(NUM_BLOCKS, BLOCK_SIZE, PAGES_PER_SEQ)

        @jax.jit
        def step(state, ids, pos, caches, md, rows):
            m = nnx.merge(self.graphdef, state)
            h, caches = m(ids, pos, caches, md)
            return m.compute_logits(h[rows]), caches

        self._step = step

    def run(self, new_tokens: dict[int, Sequence[int]], rows: np.ndarray, **pad) -> np.ndarray:
        ids, pos, md = self.pb.step(new_tokens, **pad)
        logits, self.caches = self._step(self.state, ids, pos, self.caches, md, jnp.asarray(rows))
        return np.asarray(logits)


@dataclasses.dataclass
class ParityResult:
    prefill_max_diff: float
    decode_max_diff: float
    tokens_equal: bool
    ours: list[list[int]]
    ref: list[list[int]]


def hf_greedy(hf_model, prompt: Sequence[int], steps: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """HF: (greedy tokens, prompt logits [L, V], logits of each generated step [steps, V]).

    Full recomputation each step (no HF cache, no EOS stop, no logits processors): the plain
    model function is the reference."""
    seq = list(prompt)
    step_logits = []
    with torch.no_grad():
        prompt_logits = hf_model(torch.tensor([seq])).logits[0].numpy()
        last = prompt_logits[-1]
        for _ in range(steps):
            step_logits.append(last)
            seq.append(int(np.argmax(last)))
            last = hf_model(torch.tensor([seq])).logits[0, -1].numpy()
    return seq[len(prompt):], prompt_logits, np.stack(step_logits)


def run_parity(path: str, prompts: Sequence[Sequence[int]], steps: int = 32, chunk: int | None = None) -> ParityResult:
    """Prefill all prompts in one padded step (or in chunks of ``chunk`` tokens), then
    ``steps`` greedy decode steps of all sequences together; compare with HF per prompt."""
    model, config, cls = build_model(path)
    runner = JaxRunner(model, config, cls)
    hf = load_hf_model(path)
    refs = [hf_greedy(hf, p, steps) for p in prompts]

    prefill_diff = 0.0
    first: dict[int, int] = {}  # our greedy token after each prompt
    if chunk is None:
        batch = {i: list(p) for i, p in enumerate(prompts)}
        rows = np.arange(sum(len(p) for p in prompts), dtype=np.int32)
        logits = runner.run(batch, rows, pad_tokens=3, pad_rows=1)
        start = 0
        for p, (_, ref_prompt, _) in zip(prompts, refs):
            prefill_diff = max(prefill_diff, float(np.abs(logits[start : start + len(p)] - ref_prompt).max()))
            start += len(p)
            first[len(first)] = int(np.argmax(logits[start - 1]))
    else:
        # Chunked prefill: every prompt advances by `chunk` tokens per step (context from cache).
        done = [0] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            batch = {i: list(p[done[i] : done[i] + chunk]) for i, p in enumerate(prompts) if done[i] < len(p)}
            rows = np.arange(sum(len(t) for t in batch.values()), dtype=np.int32)
            logits = runner.run(batch, rows)
            start = 0
            for i, toks in batch.items():
                ref = refs[i][1][done[i] : done[i] + len(toks)]
                prefill_diff = max(prefill_diff, float(np.abs(logits[start : start + len(toks)] - ref).max()))
                start += len(toks)
                done[i] += len(toks)
                if done[i] == len(prompts[i]):
                    first[i] = int(np.argmax(logits[start - 1]))

    ours = [[first[i]] for i in range(len(prompts))]
    decode_diff = 0.0
    for s in range(1, steps):
        batch = {i: [ours[i][-1]] for i in range(len(prompts))}
        logits = runner.run(batch, np.arange(len(prompts), dtype=np.int32))
        for i in range(len(prompts)):
            if ours[i] == refs[i][0][: len(ours[i])]:
                # Same history as HF so far: its step-s logits are the reference.
                decode_diff = max(decode_diff, float(np.abs(logits[i] - refs[i][2][s]).max()))
            ours[i].append(int(np.argmax(logits[i])))
    ref_toks = [r[0] for r in refs]
    logger.info("prefill diff %.3g decode diff %.3g", prefill_diff, decode_diff)
    return ParityResult(prefill_diff, decode_diff, ours == ref_toks, ours, ref_toks)
