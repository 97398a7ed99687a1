"""vLLM's datasets (random, sharegpt, custom) and the serving metrics' definitions, without a server."""

from __future__ import annotations

import argparse
import json

import pytest
from transformers import AutoTokenizer

from jaxlm.benchmarks.datasets import add_dataset_args, get_samples
from jaxlm.benchmarks.metrics import RequestOutcome, calculate_metrics, parse_percentile_args
from tests.helpers.tiny_tokenizer import add_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    add_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    return p.parse_args(list(argv))


def test_random_lengths_within_the_range_and_seeded(tokenizer):
    args = _args("--num-prompts", "20", "--random-input-len", "40", "--random-output-len", "10",
                 "--random-range-ratio", "0.5")
    reqs = get_samples(args, tokenizer, seed=3)
    assert len(reqs) == 20
    assert all(5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({r.expected_output_len for r in reqs}) > 1  # lengths are drawn, not fixed
    special = set(tokenizer.all_special_ids)
    for r in reqs:
        # The text a server tokenizes has the counted length (re-encoded, as vLLM aligns it).
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 20 <= r.prompt_len <= 60 and not special & set(r.prompt_token_ids)
    again = get_samples(_args("--num-prompts", "20", "--random-input-len", "40", "--random-output-len", "10",
                              "--random-range-ratio", "0.5"), tokenizer, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_sharegpt_prompt_reply_length_and_filters(tokenizer, tmp_path):
    long_text = "word " * 1500
    convs = [{"conversations": [{"from": "human", "value": "The capital of France is Paris, tell me more."},
                                {"from": "gpt", "value": "Paris is the capital of France and a large city."}]},
             {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello there, friend!"}]},
             {"conversations": [{"from": "human", "value": long_text}, {"from": "gpt", "value": "ok ok ok ok ok"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = get_samples(_args("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "5"),
                       tokenizer, seed=0)
    # "hi" is under 4 tokens and the long one over 1024: only the first is kept.
    [r] = reqs
    assert r.prompt.startswith("The capital")
    assert r.expected_output_len == len(tokenizer.encode(convs[0]["conversations"][1]["value"],
                                                         add_special_tokens=False))
    fixed = get_samples(_args("--dataset-name", "sharegpt", "--dataset-path", str(path), "--output-len", "7"),
                        tokenizer, seed=0)
    assert [x.expected_output_len for x in fixed] == [7]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": 5}', "'prompt' must be a non-empty string"),
    ('{"prompt": "x", "output_len": 0}', "'output_len' must be a positive integer"),
    ("not json", "not JSON"),
    ('["prompt"]', "expected an object with 'prompt'"),
])
def test_custom_bad_line_names_its_number(tokenizer, tmp_path, line, message):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:3: .*{message}"):
        get_samples(_args("--dataset-name", "custom", "--dataset-path", str(path)), tokenizer, seed=0)


def test_dataset_flag_mistakes_are_named(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needs --dataset-path"):
        get_samples(_args("--dataset-name", "custom"), tokenizer, seed=0)
    with pytest.raises(ValueError, match="takes no --dataset-path"):
        get_samples(_args("--dataset-path", str(tmp_path)), tokenizer, seed=0)
    with pytest.raises(ValueError, match="--random-range-ratio must be in"):
        get_samples(_args("--random-range-ratio", "1.5"), tokenizer, seed=0)
    with pytest.raises(ValueError, match="unknown bogus"):
        parse_percentile_args("ttft,bogus", "99")


def test_metrics_follow_vllms_definitions():
    # Two requests: TTFT 0.1 / 0.3 s, 5 and 1 output tokens, latencies 0.5 / 0.3 s; one failure.
    outs = [RequestOutcome(True, prompt_len=10, output_tokens=5, start_time=0.0, ttft=0.1, latency=0.5,
                           itl=[0.1, 0.1, 0.1, 0.1]),
            RequestOutcome(True, prompt_len=20, output_tokens=1, start_time=0.2, ttft=0.3, latency=0.3),
            RequestOutcome(False, error="boom", prompt_len=7)]
    res = calculate_metrics(outs, 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 99])
    assert (res["completed"], res["failed"], res["total_input_tokens"], res["total_output_tokens"]) == (2, 1, 30, 6)
    assert res["request_throughput"] == 1.0 and res["output_throughput"] == 3.0 and res["total_token_throughput"] == 18
    assert res["mean_ttft_ms"] == pytest.approx(200) and res["median_ttft_ms"] == pytest.approx(200)
    assert res["mean_tpot_ms"] == pytest.approx(100)  # (0.5 - 0.1) / 4; the one-token request has no TPOT
    assert res["p99_itl_ms"] == pytest.approx(100) and res["mean_e2el_ms"] == pytest.approx(400)
    assert res["max_output_tokens_per_s"] == 6 and res["max_concurrent_requests"] == 2
