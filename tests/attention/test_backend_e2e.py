"""End to end on a tiny model: the pallas backend (interpret mode on CPU) and the cpu backend (the
C++ decode kernel) give the xla backend's tokens, and with pallas decode-only steps run the decode
kernel, every other step the ragged one."""

import jax
import numpy as np

import jaxlm.attention.pallas_backend as pallas_backend
from jaxlm import LLM, SamplingParams
from jaxlm.sample.metadata import SERVING_VARIANTS
from tests.helpers.tiny_models import make_tiny_engine_model


def _spy(name, kernel, calls):
    """The kernel, plus a host callback that logs (kernel, tokens) each time a program runs it."""

    def wrapped(q, *args, **kwargs):
        out = kernel(q, *args, **kwargs)
        jax.debug.callback(lambda: calls.append((name, q.shape[0])))
        return out

    return wrapped


def _record_steps(runner, calls, steps):
    """Per step: (decode only?, token bucket, the kernels its program ran)."""
    execute = runner.execute_model

    def spy(so, **kw):
        calls.clear()
        out = execute(so, **kw)  # non_block under async scheduling: the barrier below waits
        jax.effects_barrier()
        decode_only = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) > 0
        steps.append((decode_only, so.total_num_scheduled_tokens, set(calls)))
        return out

    runner.execute_model = spy


def test_pallas_equals_xla_and_decode_steps_run_the_decode_kernel(tmp_path, monkeypatch, request):
    path = make_tiny_engine_model("llama", tmp_path / "llama", num_key_value_heads=1)
    rng = np.random.default_rng(3)
    # Prefill, chunked prefill (budget 32), a shared prefix (cache hits) and decode steps.
    prefix = rng.integers(3, 384, 20).tolist()
    prompts = [{"prompt_token_ids": prefix + rng.integers(3, 384, int(n)).tolist()} for n in (1, 9, 30)]
    prompts.append({"prompt_token_ids": rng.integers(3, 384, 5).tolist()})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    calls, steps, outs = [], [], {}
    monkeypatch.setattr(pallas_backend, "paged_decode_attention",
                        _spy("decode", pallas_backend.paged_decode_attention, calls))
    monkeypatch.setattr(pallas_backend, "ragged_paged_attention",
                        _spy("ragged", pallas_backend.ragged_paged_attention, calls))
    for backend in ("xla", "pallas", "cpu"):
        if backend == "cpu":
            request.getfixturevalue("cpu_kernels")
        # Few blocks: in interpret mode every kernel program reads a whole cache head.
        llm = LLM(model=path, attention_backend=backend, max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=96, token_buckets=[8, 32], seq_buckets=[4], num_gpu_blocks_override=28)
        runner = llm.llm_engine.get_model_runner()
        if backend == "pallas":
            # One decode body, for the bucket holding max_num_seqs = 4 tokens.
            assert runner.decode_buckets == [8] and runner.num_programs == 2 + 1 + 1 + len(SERVING_VARIANTS)
            _record_steps(runner, calls, steps)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["pallas"] == outs["xla"] == outs["cpu"]
    assert all(len(t) == 10 for t in outs["xla"])
    decode_steps = [s for s in steps if s[0]]
    assert len(decode_steps) >= 5 and len(steps) > len(decode_steps)
    for decode_only, num_tokens, kernels in steps:
        if num_tokens == 0:  # async scheduling's last call only collects the step in flight
            assert kernels == set()
            continue
        # Every layer of the step's program ran one kernel, in the bucket of the step.
        bucket = 8 if num_tokens <= 8 else 32
        assert kernels == {("decode" if decode_only else "ragged", bucket)}, (decode_only, num_tokens, kernels)
