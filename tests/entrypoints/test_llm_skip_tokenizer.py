"""LLM(skip_tokenizer_init=True) on a checkpoint without tokenizer files: token ids in and out."""

import os

import pytest

from jaxlm import LLM, BeamSearchParams, SamplingParams
from tests.entrypoints.conftest import ENGINE_KWARGS
from tests.helpers.tiny_models import make_tiny_model
from tests.helpers.tiny_tokenizer import EOS_ID, TINY_VOCAB


@pytest.fixture(scope="module")
def bare_path(tmp_path_factory):
    # The shared engine model's weights and shapes (same seed), with no tokenizer files at all.
    path = make_tiny_model("llama", tmp_path_factory.mktemp("bare"), with_tokenizer=False, vocab_size=TINY_VOCAB)
    assert not [f for f in os.listdir(path) if "token" in f or f.endswith(".model")]
    return path


@pytest.fixture(scope="module")
def bare_llm(bare_path):
    return LLM(model=bare_path, skip_tokenizer_init=True, **ENGINE_KWARGS)


def test_a_checkpoint_without_tokenizer_files_needs_the_flag(bare_path):
    with pytest.raises(ValueError, match="no tokenizer files .* --skip-tokenizer-init"):
        LLM(model=bare_path, **ENGINE_KWARGS)


def test_token_ids_in_and_out_as_with_a_tokenizer(bare_llm, priority_llm):
    assert bare_llm.get_tokenizer() is None
    ids = priority_llm.get_tokenizer().encode("The capital of France is")
    for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
                   # EOS forced after 2 tokens: the model config's EOS ends it, as the tokenizer's does.
                   SamplingParams(temperature=0, max_tokens=40, logprobs=1, min_tokens=2, logit_bias={EOS_ID: 50.0})):
        [out] = bare_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        [ref] = priority_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        got, want = out.outputs[0], ref.outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.stop_reason == want.stop_reason
        assert got.finish_reason == ("length" if params.ignore_eos else "stop")
        assert got.text == "" and out.prompt is None and out.prompt_token_ids == ids
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-5)
        assert all(lp.decoded_token is None for pos in got.logprobs for lp in pos.values())
    [bare] = bare_llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=6))
    [full] = priority_llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=6))
    assert [s.tokens for s in bare.sequences] == [s.tokens for s in full.sequences]
    assert all(s.text == "" for s in bare.sequences)
    assert bare_llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0


@pytest.mark.parametrize("prompt,params,message", [
    ("text", SamplingParams(), "skip_tokenizer_init is set .*prompts must be token ids"),
    ({"prompt": "text"}, SamplingParams(), "prompts must be token ids"),
    ([5, 6], SamplingParams(stop=["x"]), "stop needs a tokenizer"),
    ([5, 6], SamplingParams(bad_words=["x"]), "bad_words needs a tokenizer"),
    ([5, 6], SamplingParams(structured_outputs={"json": {"type": "object"}}), "structured_outputs needs a tokenizer"),
])
def test_text_needs_a_tokenizer(bare_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        bare_llm.generate([[7, 8], prompt], params, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True: pass token ids"):
        bare_llm.chat([{"role": "user", "content": "hi"}])
    [out] = bare_llm.generate([[7, 8]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    assert bare_llm.llm_engine.get_stats()["kv_cache_usage_perc"] == 0.0
