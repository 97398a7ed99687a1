"""The persistent input batch flattens a step exactly as the attention metadata contract says."""

import numpy as np

from jaxlm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxlm.sampling_params import SamplingParams
from jaxlm.worker.buckets import (decode_buckets, default_seq_buckets, default_token_buckets, pick_bucket,
                                  powers_of_two_up_to, prompt_logprobs_buckets, validate_buckets)
from jaxlm.worker.input_batch import InputBatch


def _new(req_id, prompt, blocks, computed=0, output=()):
    return NewRequestData(req_id, list(prompt), list(output), SamplingParams(), list(blocks), computed)


def test_buckets():
    assert powers_of_two_up_to(100) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert default_seq_buckets(64) == [1, 4, 16, 64] and default_seq_buckets(8) == [1, 4, 16]
    assert default_token_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert pick_bucket(17, [8, 16, 32]) == 32 and pick_bucket(16, [8, 16, 32]) == 16
    assert validate_buckets([32, 8, 8], 20, "token") == [8, 32]
    for bad in ([], [0, 8]):
        try:
            validate_buckets(bad, 4, "token")
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


def test_decode_buckets_reach_max_num_seqs():
    tokens = default_token_buckets(512)
    assert decode_buckets(tokens, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(tokens, 48) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets([16, 64], 4) == [16]
    assert decode_buckets([8, 16], 256) == [8, 16]  # budget below max_num_seqs


def test_prompt_logprobs_buckets_keep_the_largest():
    assert prompt_logprobs_buckets(default_token_buckets(512)) == [2, 8, 32, 128, 512]
    assert prompt_logprobs_buckets([16, 64]) == [64] and prompt_logprobs_buckets([16]) == [16]


def test_block_table_width_is_rounded_to_the_page_multiple():
    assert InputBatch(2, 100, 16).max_pages == 7
    assert InputBatch(2, 100, 16, page_multiple=4).max_pages == 8
    assert InputBatch(2, 128, 16, page_multiple=8).max_pages == 8


def test_prepare_mixed_step():
    bs = 4
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=bs)
    # a: 10-token prompt, 4 cached (prefix hit), chunk of 5 this step -> no sample
    # b: 3-token prompt + 2 outputs resumed after preemption, all 5 computed now -> samples
    so = SchedulerOutput(
        scheduled_new_reqs=[_new("a", range(100, 110), [7, 3, 9], computed=4),
                            _new("b", [1, 2, 3], [5, 6], output=[40, 41])],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"a": 5, "b": 5}, total_num_scheduled_tokens=10, finished_req_ids=set())
    batch.update_states(so)
    x = batch.prepare_inputs(so, num_tokens_padded=16, num_rows_padded=4, sample_capacity=8)
    assert x.input_ids[:10].tolist() == [104, 105, 106, 107, 108, 1, 2, 3, 40, 41]
    assert x.positions[:10].tolist() == [4, 5, 6, 7, 8, 0, 1, 2, 3, 4]
    # position p lives in block_table[p // 4] at offset p % 4
    assert x.slot_mapping[:10].tolist() == [3 * 4 + 0, 13, 14, 15, 9 * 4 + 0, 20, 21, 22, 23, 24]
    assert (x.slot_mapping[10:] == -1).all() and (x.positions[10:] == 0).all()
    assert x.token_to_req[:10].tolist() == [0] * 5 + [1] * 5
    assert x.query_start_loc.tolist() == [0, 5, 10, 10, 10]
    assert x.context_lens.tolist() == [4, 0, 0, 0] and x.seq_lens.tolist() == [9, 5, 0, 0]
    assert x.block_tables[0, :3].tolist() == [7, 3, 9] and x.block_tables[1, :2].tolist() == [5, 6]
    assert x.sample_req_ids == ["b"] and x.logits_indices[0] == 9

    # Next step: a finishes its prompt and b decodes its sampled token.
    batch.append_token(batch.req_id_to_row["b"], 42)
    so2 = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(["a", "b"], [[], [8]], [9, 5]),
        num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2, finished_req_ids=set())
    batch.update_states(so2)
    y = batch.prepare_inputs(so2, 2, 2, 8)
    assert y.input_ids.tolist() == [109, 42] and y.positions.tolist() == [9, 5]
    assert y.slot_mapping.tolist() == [9 * 4 + 1, 6 * 4 + 1]
    assert y.sample_req_ids == ["a", "b"] and y.logits_indices[:2].tolist() == [0, 1]

    # Finished requests leave; their rows are reused.
    so3 = SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"a", "b"})
    batch.update_states(so3)
    assert len(batch) == 0


def test_rows_with_context_come_first():
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=4)
    so = SchedulerOutput(
        scheduled_new_reqs=[_new("fresh", [1, 2, 3], [0]), _new("hit", range(10, 19), [1, 2, 3], computed=8)],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"fresh": 3, "hit": 1}, total_num_scheduled_tokens=4, finished_req_ids=set())
    batch.update_states(so)
    x = batch.prepare_inputs(so, 4, 4, 4)
    assert x.req_ids == ["hit", "fresh"]
    assert x.context_lens[:2].tolist() == [8, 0] and x.input_ids.tolist() == [18, 1, 2, 3]
    assert x.sample_req_ids == ["hit", "fresh"] and x.logits_indices[:2].tolist() == [0, 3]


def test_placeholder_tokens_come_from_the_previous_step_on_device():
    """Async scheduling: a sampled token not back on the host yet is read from the previous
    step's device tokens (prev_idx); when it arrives it is written where its request still
    holds the row, and never into a row another request took meanwhile."""
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=4)
    so = SchedulerOutput(scheduled_new_reqs=[_new("a", [1, 2, 3], [5]), _new("b", [7, 8], [6])],
                         scheduled_cached_reqs=CachedRequestData(),
                         num_scheduled_tokens={"a": 3, "b": 2}, total_num_scheduled_tokens=5, finished_req_ids=set())
    batch.update_states(so)
    x = batch.prepare_inputs(so, 8, 4, 4)
    assert x.sample_req_ids == ["a", "b"] and x.prev_idx.tolist() == [-1] * 8
    assert x.packed.size == sum(a.size for a in (x.input_ids, x.positions, x.slot_mapping, x.token_to_req,
                                                 x.block_tables, x.seq_lens, x.context_lens,
                                                 x.query_start_loc, x.logits_indices, x.prev_idx))
    placed = batch.append_placeholders(x.sample_req_ids)  # dispatched, tokens in flight
    # The next step decodes both on their placeholders before the tokens are back.
    so2 = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(["b", "a"], [[], []], [2, 3]),
                          num_scheduled_tokens={"b": 1, "a": 1}, total_num_scheduled_tokens=2, finished_req_ids=set())
    batch.update_states(so2)
    y = batch.prepare_inputs(so2, 2, 2, 4)
    assert y.req_ids == ["b", "a"] and y.prev_idx.tolist() == [1, 0] and y.sample_req_ids == ["b", "a"]
    assert y.positions.tolist() == [2, 3]
    # "b" leaves and "c" takes its row before step 1's tokens are back: only "a" is written.
    so3 = SchedulerOutput(scheduled_new_reqs=[_new("c", [9], [7])], scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={"c": 1}, total_num_scheduled_tokens=1, finished_req_ids={"b"})
    batch.update_states(so3)
    live = batch.fill_placeholders(["a", "b"], *placed, np.array([50, 60], np.int32))
    assert live.tolist() == [True, False]
    a, c = batch.req_id_to_row["a"], batch.req_id_to_row["c"]
    assert batch.token_ids[a, :4].tolist() == [1, 2, 3, 50] and batch.pending_pos[a] == -1
    assert batch.token_ids[c, 0] == 9 and batch.num_tokens[c] == 1 and batch.token_ids[c, 2] != 60
