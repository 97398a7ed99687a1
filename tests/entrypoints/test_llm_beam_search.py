"""LLM.beam_search against transformers' beam search, its scoring, and its prefix-cache sharing."""

import math

import pytest
import torch

from jaxlm import BeamSearchParams
from jaxlm.beam_search import get_beam_search_score
from tests.helpers.tiny_models import load_hf_model

PROMPTS = ["The capital of France is", "Hello world, how", "one two three"]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_path):
    model = load_hf_model(tiny_llama_path)
    # No EOS: jaxlm's ignore_eos=True, so no beam ever ends early on either side.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers(priority_llm, hf_model, width):
    tok = priority_llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    max_tokens = 10
    outs = priority_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                    BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        hf = hf_model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=max_tokens,
                               num_return_sequences=width, output_scores=True, return_dict_in_generate=True)
        hf_seqs = [s.tolist() for s in hf.sequences]
        seqs = out.sequences
        assert len(seqs) == width
        assert seqs[0].tokens == hf_seqs[0]  # the best beam
        assert [s.tokens for s in seqs] == hf_seqs  # and every beam, in order (margins > 1e-2 here)
        # transformers scores by generated length; all beams have max_tokens of them here.
        for s, hf_score in zip(seqs, hf.sequences_scores.tolist()):
            assert s.cum_logprob / max_tokens == pytest.approx(hf_score, abs=1e-4)
        assert len({tuple(s.tokens) for s in seqs}) == width  # distinct
        for s in seqs:
            new = s.tokens[len(prompt):]
            assert len(new) == len(s.logprobs) == max_tokens
            assert math.isclose(s.cum_logprob, sum(lp[t].logprob for lp, t in zip(s.logprobs, new)), abs_tol=1e-5)
            assert s.text == tok.decode(s.tokens)  # vLLM's LLM.beam_search decodes the prompt too
    assert priority_llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0


def test_beams_share_the_prompt_through_the_prefix_cache(priority_llm):
    tok = priority_llm.get_tokenizer()
    block = 16
    prompt = tok.encode("The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3)[:2 * block]
    assert len(prompt) == 2 * block
    engine = priority_llm.llm_engine
    before = engine.get_stats()
    width, max_tokens = 4, 6
    [out] = priority_llm.beam_search([{"prompt_token_ids": prompt}],
                                     BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    after = engine.get_stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    # Step 1 runs the prompt alone; each later step runs `width` beams of prompt + k tokens.
    num_requests = 1 + width * (max_tokens - 1)
    assert queries == sum(len(prompt) + k for k in range(max_tokens)
                          for _ in range(1 if k == 0 else width))
    # Every request after the first finds the whole prompt (two full blocks) in the cache, so
    # the prompt is computed once for the beam group; only the beams' own tails are computed.
    assert hits >= (num_requests - 1) * len(prompt)
    assert queries - hits <= len(prompt) + (num_requests - 1) * block
    assert len(out.sequences) == width


def test_eos_beams_are_kept_aside_and_ranked_with_length_penalty(priority_llm):
    eos = priority_llm.llm_engine.eos_token_id
    prompt = priority_llm.get_tokenizer().encode("Hello")
    best = {}
    for penalty in (0.0, 1.0, 2.0):
        [out] = priority_llm.beam_search([{"prompt_token_ids": prompt}],
                                         BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=penalty))
        seqs = out.sequences
        best[penalty] = seqs[0]
        for s in seqs:
            assert (s.finish_reason == "stop") == (s.tokens[-1] == eos)
            assert s.finish_reason == "stop" or len(s.logprobs) == 12
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, penalty) for s in seqs]
        assert scores == sorted(scores, reverse=True)
    # This tiny model ends beams early on this prompt (EOS, kept aside): with no penalty such a
    # short beam wins, with a large one a beam that ran all max_tokens.
    assert best[0.0].finish_reason == "stop" and best[2.0].finish_reason == "length"


def test_beam_search_bad_input(priority_llm):
    with pytest.raises(ValueError, match="beam_width=11 needs 2 x beam_width = 22 logprobs"):
        priority_llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        priority_llm.beam_search([{"prompt_token_ids": [5] * 200}], BeamSearchParams(beam_width=2, max_tokens=2))
    # Near max_model_len (128) the beams end with "length" where the model runs out of room.
    [edge] = priority_llm.beam_search([{"prompt_token_ids": [5] * 120}],
                                      BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))
    assert all(len(s.tokens) == 128 and s.finish_reason == "length" for s in edge.sequences)
    assert priority_llm.llm_engine.get_stats()["kv_cache_usage_perc"] == 0.0
