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

from jaxlm.attention.backends import get_attention_backend
from jaxlm.model_loader.safetensors_utils import iterate_safetensors_file
from jaxlm.models import get_model_architecture
from jaxlm.models.quantization import get_quantization_config
from jaxlm.models.quantization.model_quant import process_weights_after_loading
from tests.helpers.paged_batch import PagedBatchBuilder, make_kv_caches
from tests.helpers.tiny_models import load_hf_model

logger = logging.getLogger(__name__)

TOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 128
PAGES_PER_SEQ = 24  # 96 tokens per sequence
# Every step (prefill, chunk, decode) is padded to one token bucket and one row bucket, the
# way the runner pads, so each test compiles a single program.
TOKEN_BUCKET = 48
ROW_BUCKET = 4


def build_model(path: str, dtype=jnp.float32, max_model_len: int | None = None, backend: str = "xla",
                quantization: str | None = None):
    """Abstract model (no memory) + load_weights from the safetensors file, as the loader does;
    ``backend="pallas"`` runs the Pallas kernels (interpret mode on CPU). A quantized checkpoint
    (or ``quantization``) builds the quantized model and processes its weights after loading."""
    config = transformers.AutoConfig.from_pretrained(path)
    cls = get_model_architecture(config)
    quant_config = get_quantization_config(quantization, config)
    model = nnx.eval_shape(
        lambda: cls(config, dtype=dtype, attn_backend=get_attention_backend(backend), rngs=nnx.Rngs(0),
                    max_model_len=max_model_len, quant_config=quant_config)
    )
    loaded = model.load_weights(iterate_safetensors_file(os.path.join(path, "model.safetensors")))
    missing = model.expected_weight_names() - loaded
    assert not missing, f"missing weights: {sorted(missing)}"
    process_weights_after_loading(model)
    return model, config, cls


class JaxRunner:
    """Jitted step (model body + logits at chosen rows) over the model's split state."""

    def __init__(self, model, config, cls):
        self.graphdef, self.state = nnx.split(model)
        self.config = config
        self.caches = make_kv_caches(cls.get_kv_cache_spec(config), NUM_BLOCKS, BLOCK_SIZE)
        self.pb = PagedBatchBuilder(NUM_BLOCKS, BLOCK_SIZE, PAGES_PER_SEQ)

        @jax.jit
        def step(state, ids, pos, caches, md):
            m = nnx.merge(self.graphdef, state)
            h, caches = m(ids, pos, caches, md)
            return m.compute_logits(h), caches

        self._step = step

    def run(self, new_tokens: dict[int, Sequence[int]], token_bucket: int = TOKEN_BUCKET) -> np.ndarray:
        """Logits [tokens of the step, V] of one step padded to the buckets (a smaller
        ``token_bucket``: a second program, for kernels that pick their path by rows)."""
        n_tok = sum(len(t) for t in new_tokens.values())
        assert n_tok <= token_bucket and len(new_tokens) < ROW_BUCKET
        ids, pos, md = self.pb.step(
            new_tokens, pad_tokens=token_bucket - n_tok, pad_rows=ROW_BUCKET - len(new_tokens)
        )
        logits, self.caches = self._step(self.state, ids, pos, self.caches, md)
        return np.asarray(logits)[:n_tok]


@dataclasses.dataclass
class ParityResult:
    prefill_max_diff: float
    decode_max_diff: float
    tokens_equal: bool
    ours: list[list[int]]
    ref: list[list[int]]


def hf_logits(hf_model, seq: Sequence[int]) -> np.ndarray:
    """HF logits [len(seq), V] of one full forward (no cache: the plain model function)."""
    with torch.no_grad():
        return hf_model(torch.tensor([list(seq)])).logits[0].numpy()


def run_parity(path: str, prompts: Sequence[Sequence[int]], steps: int = 32, chunk: int | None = None,
               max_model_len: int | None = None, backend: str = "xla", ref_path: str | None = None,
               quantization: str | None = None) -> ParityResult:
    """Prefill all prompts in one padded step (or in chunks of ``chunk`` tokens), then greedy
    decode all sequences together over the paged cache for ``steps`` tokens.

    HF check, teacher-forced: one HF forward over prompt + our tokens gives, at each position,
    the logits HF's own greedy loop would see if its history equals ours; so our tokens are
    HF's greedy tokens iff each one is the argmax of HF's logits at the position before it.
    ``ref_path``: the checkpoint transformers runs (default ``path``; a quantized model's float
    checkpoint of its dequantized weights)."""
    model, config, cls = build_model(path, max_model_len=max_model_len, backend=backend, quantization=quantization)
    runner = JaxRunner(model, config, cls)
    n = len(prompts)
    prompt_logits: list[list[np.ndarray]] = [[] for _ in range(n)]
    if chunk is None:
        batch = {i: list(p) for i, p in enumerate(prompts)}
        logits = runner.run(batch)
        ends = np.cumsum([len(p) for p in prompts])
        for i in range(n):
            prompt_logits[i].append(logits[ends[i] - len(prompts[i]) : ends[i]])
    else:
        # Chunked prefill: every prompt advances by `chunk` tokens per step (context from cache).
        done = [0] * n
        while any(d < len(p) for d, p in zip(done, prompts)):
            batch = {i: list(p[done[i] : done[i] + chunk]) for i, p in enumerate(prompts) if done[i] < len(p)}
            logits = runner.run(batch)
            start = 0
            for i, toks in batch.items():
                prompt_logits[i].append(logits[start : start + len(toks)])
                start += len(toks)
                done[i] += len(toks)
    ours_prompt = [np.concatenate(parts) for parts in prompt_logits]
    step_logits = [[lg[-1]] for lg in ours_prompt]
    ours = [[int(np.argmax(lg[-1]))] for lg in ours_prompt]
    for _ in range(1, steps):
        logits = runner.run({i: [ours[i][-1]] for i in range(n)})
        for i in range(n):
            step_logits[i].append(logits[i])
            ours[i].append(int(np.argmax(logits[i])))

    hf = load_hf_model(ref_path or path)
    prefill_diff = decode_diff = 0.0
    ref_toks = []
    for i, p in enumerate(prompts):
        ref = hf_logits(hf, list(p) + ours[i][:-1])  # [L + steps - 1, V]
        L = len(p)
        prefill_diff = max(prefill_diff, float(np.abs(ours_prompt[i] - ref[:L]).max()))
        decode_diff = max(decode_diff, float(np.abs(np.stack(step_logits[i][1:]) - ref[L:]).max()))
        ref_toks.append([int(t) for t in np.argmax(ref[L - 1 :], axis=-1)])
    logger.info("prefill diff %.3g decode diff %.3g", prefill_diff, decode_diff)
    return ParityResult(prefill_diff, decode_diff, ours == ref_toks, ours, ref_toks)


def assert_parity(res: ParityResult, case: str, record_property=None, tol: float = TOL) -> None:
    """Both logit diffs within ``tol`` and the greedy tokens equal (diffs recorded and printed)."""
    if record_property is not None:
        record_property("prefill_max_diff", res.prefill_max_diff)
        record_property("decode_max_diff", res.decode_max_diff)
    print(f"{case}: prefill max|diff| {res.prefill_max_diff:.2e}, decode {res.decode_max_diff:.2e}")
    assert res.prefill_max_diff < tol, res.prefill_max_diff
    assert res.decode_max_diff < tol, res.decode_max_diff
    assert res.tokens_equal, f"ours {res.ours}\nhf   {res.ref}"
