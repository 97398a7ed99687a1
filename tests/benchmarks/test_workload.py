"""Benchmark workloads: synthetic lengths, JSONL and ShareGPT parsing, arrivals, clear errors."""

import json
import math

import pytest

from jaxlm.benchmarks.workload import Workload, WorkloadRequest, load_workload


class WordTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text, add_special_tokens=True):
        return [len(w) for w in text.split()]


def test_synthetic_lengths_in_range_and_seeded():
    wl = load_workload("synthetic:num=50,prompt=300-340,output=4-8,seed=3", vocab_size=320)
    assert len(wl.requests) == 50
    assert all(300 <= len(r.prompt_token_ids) <= 340 and 4 <= r.output_len <= 8 for r in wl.requests)
    assert all(0 <= t < 320 for r in wl.requests for t in r.prompt_token_ids)
    again = load_workload("synthetic:num=50,prompt=300-340,output=4-8,seed=3", vocab_size=320)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in wl.requests]
    assert len(load_workload("synthetic", vocab_size=1000, num=5).requests) == 5


@pytest.mark.parametrize("spec,msg", [
    ("synthetic:prompt=10", None), ("synthetic:prompts=1-2", "use num, prompt"), ("synthetic:prompt=9-3", "LO <= HI"),
    ("synthetic:output=a-b", "expected LO-HI"), ("nope.jsonl", "not 'synthetic"),
])
def test_synthetic_spec_errors(spec, msg):
    if msg is None:
        assert {len(r.prompt_token_ids) for r in load_workload(spec, 320).requests} == {10}
        return
    with pytest.raises(ValueError, match=msg):
        load_workload(spec, 320)


def test_jsonl(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a bb ccc", "max_tokens": 5}\n\n{"prompt_token_ids": [7, 8]}\n')
    wl = load_workload(str(path), 320, default_output_len=9).tokenized(WordTokenizer())
    assert [(r.prompt_token_ids, r.output_len) for r in wl.requests] == [([1, 2, 3], 5), ([7, 8], 9)]
    with pytest.raises(ValueError, match="a tokenizer is needed"):
        load_workload(str(path), 320).tokenized(None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: expected an object with 'prompt'"):
        load_workload(str(bad), 320)


def test_sharegpt_first_human_turn_and_reply_length(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "one two three"}]},
        {"conversations": [{"from": "gpt", "value": "alone"}]},  # no human turn: skipped
        {"conversations": [{"from": "system", "value": "s"}, {"from": "user", "value": "q"},
                           {"from": "assistant", "value": "a b"}]},
    ]))
    wl = load_workload(str(path), 320).tokenized(WordTokenizer())
    assert [(r.prompt_token_ids, r.output_len) for r in wl.requests] == [([2, 5], 3), ([1], 2)]
    assert len(load_workload(str(path), 320, num=1).requests) == 1


def test_arrivals_and_fitting():
    wl = Workload("w", [WorkloadRequest(4, prompt_token_ids=[1] * n) for n in (3, 10, 30)])
    offline = wl.with_request_rate(math.inf)
    assert [r.arrival_time for r in offline.requests] == [0, 0, 0]
    timed = wl.with_request_rate(2.0, seed=0)
    times = [r.arrival_time for r in timed.requests]
    assert times == sorted(times) and times[0] > 0
    assert [len(r.prompt_token_ids) for r in wl.fitting(16).requests] == [3, 10]
    with pytest.raises(ValueError, match="no request fits"):
        wl.fitting(4)
    with pytest.raises(ValueError, match="must be positive"):
        wl.with_request_rate(0)
