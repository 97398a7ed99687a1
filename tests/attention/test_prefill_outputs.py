"""Through LLM.generate, the prefill paths give the outputs of a plain dense run: greedy tokens
equal and logprobs within 1e-5.

Under test: the XLA backend with a 16-token step budget (prompts take 1 to 5 chunks), prefix
caching on with prefixes shared at every length mod the block size, every request in flight at
once (steps mix decode rows with prefill chunks), on a model with a full-attention layer and a
sliding-window layer (window 8, shorter than most prompts). Reference: the same model with a
dense attention backend (every key gathered per token), every prompt in one step, no cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxlm import LLM, SamplingParams
from tests.helpers.dense_attention import dense_xla_backend
from tests.helpers.tiny_models import make_tiny_engine_model

BLOCK, BUDGET = 4, 16
BASE_LENS = (13, 29, 40, 58, 77)  # 1, 2, 3, 4, 5 chunks of 16 when alone
# (base prompt, shared length, suffix length): the shared length is 0, 1, 2, 3 mod BLOCK.
HITS = ((1, 28, 1), (2, 37, 3), (3, 54, 9), (4, 75, 20))
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def _spy(runner):
    """Per request (engine id): its prompt length, cached tokens and tokens scheduled per step."""
    reqs, mixed = {}, []
    execute = runner.execute_model

    def spy(so, **kw):
        for new in so.scheduled_new_reqs:
            reqs[new.req_id] = dict(prompt=len(new.prompt_token_ids), cached=new.num_computed_tokens, steps=[])
        for r, n in so.num_scheduled_tokens.items():
            reqs[r]["steps"].append(n)
        counts = list(so.num_scheduled_tokens.values())
        mixed.append(bool(counts) and min(counts) == 1 and max(counts) > 1)
        return execute(so, **kw)

    runner.execute_model = spy
    return reqs, mixed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = make_tiny_engine_model("qwen2", tmp_path_factory.mktemp("m") / "qwen2_sw", use_sliding_window=True,
                                  sliding_window=8, max_window_layers=1)
    rng = np.random.default_rng(29)
    base = [rng.integers(3, 384, n).tolist() for n in BASE_LENS]
    hits = [base[b][:shared] + rng.integers(3, 384, s).tolist() for b, shared, s in HITS]
    prompts = [{"prompt_token_ids": p} for p in base + hits]
    common = dict(model=path, block_size=BLOCK, max_model_len=128, seq_buckets=[16], max_num_seqs=16)

    llm = LLM(max_num_batched_tokens=BUDGET, enable_prefix_caching=True, **common)
    reqs, mixed = _spy(llm.llm_engine.get_model_runner())
    # The base prompts first (all at once), then the ones sharing their prefixes (cache hits).
    got = llm.generate(prompts[:len(base)], PARAMS, use_tqdm=False)
    got += llm.generate(prompts[len(base):], PARAMS, use_tqdm=False)
    assert llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0
    del llm
    with dense_xla_backend():
        ref_llm = LLM(max_num_batched_tokens=512, token_buckets=[512], enable_prefix_caching=False, **common)
        ref = ref_llm.generate(prompts, PARAMS, use_tqdm=False)
    return got, ref, reqs, mixed


def test_paths_were_taken(runs):
    got, _, reqs, mixed = runs
    chunks = sorted(sum(1 for _ in _prefill_steps(r)) for r in reqs.values() if not r["cached"])
    assert chunks[0] == 1 and chunks[-1] >= 5, chunks
    # Hits cover whole blocks of each shared prefix: 28, 36, 52, 72 tokens.
    assert [o.num_cached_tokens for o in got[len(BASE_LENS):]] == [s // BLOCK * BLOCK for _, s, _ in HITS]
    assert any(mixed), "no step mixed decode rows with prefill chunks"


def _prefill_steps(r):
    done = r["cached"]
    for n in r["steps"]:
        if done >= r["prompt"]:
            return
        done += n
        yield n


def test_tokens_and_logprobs_match_dense_reference(runs):
    got, ref, _, _ = runs
    for i, (g, e) in enumerate(zip(got, ref)):
        g, e = g.outputs[0], e.outputs[0]
        assert g.token_ids == e.token_ids, f"prompt {i}"
        for pos, (lp, lp_ref) in enumerate(zip(g.logprobs, e.logprobs)):
            tok = g.token_ids[pos]
            assert abs(lp[tok].logprob - lp_ref[tok].logprob) <= 1e-5, (i, pos)
            for t in lp.keys() & lp_ref.keys():
                assert abs(lp[t].logprob - lp_ref[t].logprob) <= 1e-5, (i, pos, t)
