"""End to end on a tiny model: the pallas backend (interpret mode on CPU) gives the xla backend's tokens."""

import numpy as np

from jaxlm import LLM, SamplingParams
from tests.helpers.tiny_tokenizer import make_tiny_engine_model


def test_pallas_equals_xla_greedy(tmp_path):
    path = make_tiny_engine_model("llama", tmp_path / "llama", num_key_value_heads=1)
    rng = np.random.default_rng(3)
    # Prefill, chunked prefill (budget 32), a shared prefix (cache hits) and decode steps.
    prefix = rng.integers(3, 384, 20).tolist()
    prompts = [{"prompt_token_ids": prefix + rng.integers(3, 384, int(n)).tolist()} for n in (1, 9, 30)]
    prompts.append({"prompt_token_ids": rng.integers(3, 384, 5).tolist()})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for backend in ("xla", "pallas"):
        # Few blocks: in interpret mode every kernel program reads a whole cache head.
        llm = LLM(model=path, attention_backend=backend, max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=96, token_buckets=[8, 32], seq_buckets=[4], num_gpu_blocks_override=28)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["pallas"] == outs["xla"]
    assert all(len(t) == 10 for t in outs["xla"])
