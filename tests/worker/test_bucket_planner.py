"""Bucket planning: padding accounting, the exact bucket search, the program budget, the scheduler
simulation and the named configurations, on hand-computed examples (no jax)."""

import dataclasses
import itertools
import random
import subprocess
import sys

import pytest

from jaxlm.config import CacheConfig, SchedulerConfig
from jaxlm.worker.bucket_planner import (StepShape, count_programs, derive_buckets, optimal_buckets,
                                         padding_of, parse_bucket_spec, plan_buckets, simulate_steps)
from jaxlm.worker.buckets import PaddingStats, default_seq_buckets, powers_of_two_up_to


@dataclasses.dataclass
class Req:
    prompt_token_ids: list
    output_len: int
    arrival_time: float = 0.0


def test_padding_stats_hand_example():
    p = PaddingStats()
    p.record(3, 4, 2, 2, 5, 8)  # 3 tokens in a 4-bucket, 2 rows of 2, 5 pages of 8 slots
    p.record(8, 8, 1, 2, 2, 8)
    p.record_samples(1, 4)
    w = p.waste()
    assert w["tokens"] == pytest.approx(1 / 12)
    assert w["rows"] == pytest.approx(1 / 4)
    assert w["pages"] == pytest.approx(9 / 16)
    assert w["samples"] == pytest.approx(3 / 4)
    assert PaddingStats().waste() == {"tokens": 0.0, "rows": 0.0, "pages": 0.0, "samples": 0.0}
    with pytest.raises(ValueError, match="tokens 5/4"):
        p.record(5, 4, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="exceed the sequence bucket"):
        p.record_samples(5, 4)


def test_optimal_buckets_hand_example():
    values = [1, 1, 3, 5, 6, 6]
    sets, costs = optimal_buckets(values, cap=8, max_buckets=3)
    # 1 bucket: all to 8 -> 7+7+5+3+2+2; 2: best extra bucket 3 -> 2+2+0+3+2+2; 3: {1, 6} -> 3+1.
    assert sets == [[8], [3, 8], [1, 6, 8]]
    assert costs == [26, 11, 4]


def test_optimal_buckets_matches_brute_force():
    rng = random.Random(0)
    for _ in range(100):
        cap = rng.randint(4, 30)
        values = [rng.randint(1, cap) for _ in range(rng.randint(0, 10))]
        k_max = rng.randint(1, 5)
        sets, costs = optimal_buckets(values, cap, k_max)
        for k in range(1, k_max + 1):
            distinct = sorted({v for v in values if v < cap})
            brute = min(sum(min(b for b in list(c) + [cap] if b >= v) - v for v in values)
                        for m in range(min(k - 1, len(distinct)) + 1)
                        for c in itertools.combinations(distinct, m))
            assert costs[k - 1] == brute
            assert len(sets[k - 1]) <= k and sets[k - 1][-1] == cap
            assert sum(min(b for b in sets[k - 1] if b >= v) - v for v in values) == brute


def test_optimal_buckets_rejects_steps_beyond_cap():
    with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
        optimal_buckets([9], cap=8, max_buckets=2)


def test_plan_buckets_trades_token_and_sequence_buckets_under_the_budget():
    steps = [StepShape(t, 1, 1, 1) for t in [1, 1, 3, 5, 6, 6]]
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    # 11 programs: 1 sequence bucket (6 samplers) leaves 5 for token buckets: 3 bodies + 2
    # prompt-logprobs bodies (every other bucket). Best 3 holding the budget 8: [1, 6, 8] (cost 4).
    plan = plan_buckets(steps, sched, max_programs=11)
    assert (plan.token_buckets, plan.seq_buckets, plan.num_programs) == ([1, 6, 8], [4], 11)
    # 16 programs: 5 token + 1 seq bucket (0 + 0.25 * 18 padded sampler rows) beats 2 token +
    # 2 seq buckets (14 padded tokens + 0).
    plan = plan_buckets(steps, sched, max_programs=16)
    assert (plan.token_buckets, plan.seq_buckets, plan.num_programs) == ([1, 3, 5, 6, 8], [4], 14)
    assert plan.expected_waste["tokens"] == 0.0
    assert plan.as_flags() == "--token-buckets 1,3,5,6,8 --seq-buckets 4"
    with pytest.raises(ValueError, match="at least 8"):
        plan_buckets(steps, sched, max_programs=6)


def test_simulate_steps_hand_example():
    # Budget 8, two prompts of 5 and 6 tokens, 2 outputs each, blocks of 4 tokens:
    # step 1: A's 5 + B's first 3 (chunked) -> A samples; pages ceil(5/4) + ceil(3/4) = 3
    # step 2: A decodes 1 + B's last 3 -> both sample (A finishes); pages 2 + 2
    # step 3: B decodes 1 -> finishes; pages ceil(7/4) = 2
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    steps = simulate_steps([Req([5] * 5, 2), Req([6] * 6, 2)], sched, CacheConfig(block_size=4))
    assert steps == [StepShape(8, 2, 3, 1), StepShape(4, 2, 4, 2), StepShape(1, 1, 2, 1)]
    # Buckets [4, 8] / [2], 4 pages a row: tokens 13 of 8+4+4, rows 5 of 2+2+2 (min(T, 2)),
    # pages 9 of 6 rows x 4, sampled rows 4 of 2+2+2.
    stats = padding_of(steps, [4, 8], [2], max_num_seqs=2, max_pages=4)
    assert (stats.real_tokens, stats.tokens, stats.real_rows, stats.rows) == (13, 16, 5, 6)
    assert (stats.real_pages, stats.pages, stats.real_samples, stats.samples) == (9, 24, 4, 6)


def test_simulate_steps_places_arrivals_on_steps():
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    reqs = [Req([1] * 4, 3, 0.0), Req([2] * 4, 3, 10.0)]
    # 1 s steps: the second request arrives at step 10, long after the first finished.
    steps = simulate_steps(reqs, sched, CacheConfig(block_size=4), step_seconds=1.0)
    assert [s.num_tokens for s in steps] == [4, 1, 1, 4, 1, 1]
    offline = simulate_steps(reqs, sched, CacheConfig(block_size=4))
    assert [s.num_tokens for s in offline] == [8, 2, 2]


def _clustered(n: int, seed: int = 0) -> list[Req]:
    rng = random.Random(seed)
    return [Req([100 + i] * rng.randint(300, 340), rng.randint(4, 24)) for i in range(n)]


@pytest.mark.parametrize("max_num_seqs", [2, 8])
def test_auto_beats_pow2_on_steps_between_two_powers_of_two(max_num_seqs):
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=384)
    cache = CacheConfig(block_size=16)
    reqs = _clustered(16)
    pow2_t, pow2_s = powers_of_two_up_to(512), default_seq_buckets(max_num_seqs)
    budget = count_programs(len(pow2_t), len(pow2_s))
    plan = derive_buckets(reqs, sched, cache, max_programs=budget)
    assert plan.num_programs <= budget
    steps = simulate_steps(reqs, sched, cache)
    pow2 = padding_of(steps, pow2_t, pow2_s, max_num_seqs, 24).waste()
    auto = padding_of(steps, plan.token_buckets, plan.seq_buckets, max_num_seqs, 24).waste()
    assert auto["tokens"] < pow2["tokens"]
    assert auto == plan.expected_waste


def test_auto_never_worse_than_pow2_on_mixed_lengths():
    rng = random.Random(1)
    reqs = [Req([7 + i] * rng.randint(16, 400), rng.randint(16, 64)) for i in range(24)]
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    cache = CacheConfig(block_size=16)
    steps = simulate_steps(reqs, sched, cache)
    pow2_t = powers_of_two_up_to(256)
    plan = plan_buckets(steps, sched, count_programs(len(pow2_t), 2), sample_row_cost=0.0)
    pow2 = padding_of(steps, pow2_t, [1, 4, 16], 8, 32)
    auto = padding_of(steps, plan.token_buckets, plan.seq_buckets, 8, 32)
    assert auto.tokens <= pow2.tokens


def test_parse_bucket_spec():
    assert parse_bucket_spec("pow2", 512, 64) == (powers_of_two_up_to(512), [1, 4, 16, 64])
    assert parse_bucket_spec("pow4", 300, 64)[0] == [1, 4, 16, 64, 256, 1024]
    assert parse_bucket_spec("linear:64", 300, 64)[0] == [64, 128, 192, 256, 320]
    assert parse_bucket_spec("16,64,256,512", 512, 8) == ([16, 64, 256, 512], [1, 4, 16])
    assert parse_bucket_spec("tokens=linear:128;seqs=1,8,64", 512, 64) == ([128, 256, 384, 512], [1, 8, 64])
    assert parse_bucket_spec("seqs=pow2", 64, 8) == (powers_of_two_up_to(64), [1, 2, 4, 8])
    for bad, msg in [("linear:x", "positive integer step"), ("16,64", r"largest bucket of '16,64' \(64\) is below 512"),
                     ("auto", "derive_buckets"), ("tokens=pow2;bogus=1", "tokens=...;seqs="),
                     ("pow3", "unknown bucket list"), ("0,512", "positive")]:
        with pytest.raises(ValueError, match=msg):
            parse_bucket_spec(bad, 512, 8)


def test_planner_does_not_import_jax():
    # The CLI and the bench's parent process plan buckets before (or without) a device.
    code = "import sys, jaxlm.worker.bucket_planner, jaxlm.benchmarks.workload; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_program_count_matches_the_runner():
    from jaxlm.sample.metadata import SERVING_VARIANTS
    from jaxlm.worker.bucket_planner import PROGRAMS_PER_SEQ_BUCKET, count_programs
    from jaxlm.worker.buckets import prompt_logprobs_buckets

    assert PROGRAMS_PER_SEQ_BUCKET == len(SERVING_VARIANTS)
    tokens, seqs = [16, 32, 64, 128, 256, 512], [1, 4, 16]
    want = len(tokens) + len(prompt_logprobs_buckets(tokens)) + len(SERVING_VARIANTS) * len(seqs)
    assert count_programs(len(tokens), len(seqs)) == want
