"""BeamSearch's bookkeeping on made-up candidates: ranking, EOS beams kept aside, length penalty."""

import math

import pytest

from jaxlm.beam_search import BeamSearch, get_beam_search_score
from jaxlm.outputs import Logprob
from jaxlm.sampling_params import BeamSearchParams

EOS = 2


def _cands(**lps):
    return {int(k[1:]): Logprob(v) for k, v in lps.items()}


def test_scores_follow_vllm():
    # The length counts the prompt and leaves out a final EOS.
    assert get_beam_search_score([7, 8, 9, EOS], -3.0, EOS, 1.0) == -1.0
    assert get_beam_search_score([7, 8, 9, 10], -4.0, EOS, 2.0) == -0.25
    assert get_beam_search_score([7, 8], -4.0, EOS, 0.0) == -4.0
    # Extreme penalties do not raise (a request may send any finite length_penalty).
    for penalty in (1e308, -1e308, 800.0, -800.0):
        scores = [get_beam_search_score([7] * n, -1.5, EOS, penalty) for n in (2, 3)]
        assert all(math.isfinite(s) and s <= 0.0 for s in scores), (penalty, scores)
    assert get_beam_search_score([7, 7], -1.5, EOS, 800.0) > get_beam_search_score([7, 7], -1.5, EOS, -800.0)


def test_beams_grow_by_their_best_candidates_and_eos_is_kept_aside():
    search = BeamSearch([[7, 8]], BeamSearchParams(beam_width=2, max_tokens=3), EOS, max_model_len=100,
                        max_logprobs=20)
    assert search.sampling_params.logprobs == 4 and search.sampling_params.max_tokens == 1
    assert search.step_prompts() == [[7, 8]]
    search.advance([_cands(t10=-0.1, t11=-0.5, t2=-0.2, t12=-3.0)])
    # EOS (-0.2) is second best, but it ends its beam: the live beams are 10 and 11.
    assert search.step_prompts() == [[7, 8, 10], [7, 8, 11]]
    search.advance([_cands(t20=-2.0, t21=-2.5), _cands(t30=-0.1, t31=-4.0)])
    # Across both parents: 11->30 (-0.6), 10->20 (-2.1); 10->21 (-2.6) drops out.
    assert search.step_prompts() == [[7, 8, 11, 30], [7, 8, 10, 20]]
    search.advance([_cands(t40=-0.1), _cands(t41=-0.1)])
    assert search.done
    [best] = search.best()
    # [7, 8, 2]: -0.2 / 2 = -0.1 beats [7, 8, 11, 30, 40]: -0.7 / 5.
    assert [b.tokens for b in best] == [[7, 8, EOS], [7, 8, 11, 30, 40]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
    assert best[1].cum_logprob == pytest.approx(-0.7)
    assert search.output_tokens(0, best[0]) == [EOS] and search.output_text_tokens(0, best[0]) == []


def test_length_penalty_changes_the_final_ranking():
    def run(penalty):
        search = BeamSearch([[7]], BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=penalty), EOS,
                            max_model_len=100, max_logprobs=20)
        search.step_prompts()
        search.advance([_cands(t2=-1.0, t10=-0.5, t11=-0.6)])
        while not search.done:
            search.advance([_cands(t20=-0.3)] * len(search.step_prompts()))
        return [b.tokens for b in search.best()[0]]

    # No penalty: the raw sum, where the short EOS beam (-1.0) beats -1.4.
    assert run(0.0) == [[7, EOS], [7, 10, 20, 20, 20]]
    # Length-normalised: -1.4 / 5 beats -1.0 / 1.
    assert run(1.0) == [[7, 10, 20, 20, 20], [7, 11, 20, 20, 20]]


def test_ignore_eos_treats_eos_as_a_token_and_max_model_len_caps_the_steps():
    search = BeamSearch([[7, 8, 9]], BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True), EOS,
                        max_model_len=5, max_logprobs=20)
    steps = 0
    while not search.done:
        search.step_prompts()
        search.advance([_cands(t2=-0.1, t10=-0.2)])
        steps += 1
    assert steps == 2  # 3 prompt tokens + 2 = max_model_len
    [[beam]] = search.best()
    assert beam.tokens == [7, 8, 9, EOS, EOS] and beam.finish_reason == "length"


def test_several_prompts_and_width_checks():
    search = BeamSearch([[1], [5, 6]], BeamSearchParams(beam_width=1, max_tokens=1), EOS, 100, 20)
    assert search.step_prompts() == [[1], [5, 6]]
    with pytest.raises(ValueError, match="expected 2 candidate sets"):
        search.advance([_cands(t3=-1.0)])
    search.advance([_cands(t3=-1.0), _cands(t4=-1.0)])
    assert [[b.tokens for b in best] for best in search.best()] == [[[1, 3]], [[5, 6, 4]]]
    with pytest.raises(ValueError, match="beam_width=3 needs 2 x beam_width = 6 logprobs per step, above "
                                         "max_logprobs=5"):
        BeamSearch([[1]], BeamSearchParams(beam_width=3, max_tokens=1), EOS, 100, 5)
    for bad in (dict(beam_width=0), dict(max_tokens=0), dict(temperature=float("nan")), dict(temperature=-1),
                dict(length_penalty=float("inf")), dict(beam_width=True), dict(max_tokens=1.5)):
        with pytest.raises(ValueError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 2, **bad})
