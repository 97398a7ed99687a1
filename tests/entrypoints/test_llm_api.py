"""The offline API on a tiny model: prompt forms, ordering, metrics, bad input failing alone, abort."""

import pytest

from jaxlm import LLM, SamplingParams
from jaxlm.sampling_params import RequestOutputKind
from tests.helpers.tiny_models import make_tiny_engine_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_engine_model("llama", tmp_path_factory.mktemp("llama"))
    return LLM(model=path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
               num_gpu_blocks_override=40, seed=0)


def _usage(llm):
    return llm.llm_engine.get_stats()["kv_cache_usage_perc"]


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text = "The capital of France is"
    ids = tok.encode(text)
    outs = llm.generate([text, {"prompt_token_ids": ids}, {"prompt": text}, "Hello"], greedy, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    # The same tokens whatever form the prompt came in.
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    assert len(outs[3].outputs[0].token_ids) == 6 and outs[3].outputs[0].finish_reason == "length"
    m = outs[0].metrics
    assert m.arrival_time <= m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
    assert m.first_token_latency == m.first_token_ts - m.arrival_time
    assert m.num_generation_tokens == len(outs[0].outputs[0].token_ids)
    # A single string or a bare token-id list is one prompt.
    assert len(llm.generate(text, greedy, use_tqdm=False)) == 1
    assert len(llm.generate(ids, greedy, use_tqdm=False)) == 1


def test_per_prompt_params(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                     SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams()] * 2)


@pytest.mark.parametrize("prompt,params,message", [
    ("x " * 200, SamplingParams(), "longer than the maximum model length of 128"),
    ("", SamplingParams(), "prompt cannot be empty"),
    ({"prompt_token_ids": [5, 99999]}, SamplingParams(), "Token id 99999 is out of vocabulary"),
    ("hi", SamplingParams(logprobs=50), "logprobs=50 exceeds max_logprobs=20"),
    ("hi", SamplingParams(stop_token_ids=[10**6]), r"stop_token_ids contains out-of-vocab token ids \[1000000\]"),
    ("hi", SamplingParams(logit_bias={-3: 1.0}), "logit_bias contains out-of-vocab"),
])
def test_bad_request_fails_alone(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert _usage(llm) == 0.0
    # The engine keeps serving.
    [out] = llm.generate(["still alive"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_invalid_sampling_params_are_rejected():
    for kwargs, message in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                            (dict(n=0), "n must"), (dict(max_tokens=0), "max_tokens")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


def test_abort_frees_blocks_and_others_finish(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in range(3):
        engine.add_request(f"abort-{i}", f"request number {i}", params)
    for _ in range(3):
        engine.step()
    assert _usage(llm) > 0
    engine.abort_request("abort-1")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "abort-1"
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"abort-0", "abort-2"}
    assert _usage(llm) == 0.0


def test_streaming_deltas_concatenate(llm):
    engine = llm.llm_engine
    delta = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("stream", "The quick brown fox", delta)
    text, tokens = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
    [final] = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    assert tokens == final.outputs[0].token_ids
    assert text == final.outputs[0].text


def test_detokenize_false_does_no_text_work(llm, monkeypatch):
    """detokenize=False (issue 38): no detokenizer and no token text for logprobs (vLLM gives
    decoded_token None), the same tokens and logprobs as with text."""
    from jaxlm.engine import output_processor
    from jaxlm.engine.logprobs import TokenDecoder

    texts, made = [], []
    decode = TokenDecoder.__call__
    monkeypatch.setattr(TokenDecoder, "__call__",
                        lambda self, ids: (self.tokenizer is not None and texts.append(len(ids))) or decode(self, ids))

    class Counting(output_processor.IncrementalDetokenizer):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", Counting)
    kw = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    [plain] = llm.generate(["The capital"], SamplingParams(**kw), use_tqdm=False)
    assert made == [1] and texts  # the counters see text work where there is some
    texts.clear(), made.clear()
    [bare] = llm.generate(["The capital"], SamplingParams(**kw, detokenize=False), use_tqdm=False)
    assert made == [] and texts == []
    got, want = bare.outputs[0], plain.outputs[0]
    assert got.text == "" and got.token_ids == want.token_ids
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in got.logprobs] == \
        [{t: lp.logprob for t, lp in pos.items()} for pos in want.logprobs]
    assert all(lp.decoded_token is None for pos in got.logprobs + bare.prompt_logprobs[1:] for lp in pos.values())
    assert all(lp.decoded_token is not None for pos in want.logprobs for lp in pos.values())


def test_host_overhead_counts_text_work_only_where_there_is_text(llm):
    """`jaxlm bench host-overhead`'s "detokenize" share is the detokenizer's own calls: none for
    LLM.generate(detokenize=False)'s requests (the H100 run read the whole output processor so)."""
    from jaxlm.benchmarks.host_overhead import measure_batch

    streamed = measure_batch(llm, 2, 4, 10, skip=1)
    bare = measure_batch(llm, 2, 4, 10, skip=1, output_kind="FINAL_ONLY", detokenize=False)
    assert streamed["shares"]["detokenize"] > 0 and streamed["shares"]["outputs"] > 0
    assert "detokenize" not in bare["shares"] and bare["shares"]["outputs"] > 0
    assert (bare["output_kind"], bare["detokenize"]) == ("FINAL_ONLY", False)
    engine = llm.llm_engine  # the timers are gone again
    assert "process_outputs" not in vars(engine.output_processor) and "schedule" not in vars(engine.scheduler)


def test_n_greater_than_one(llm):
    [out] = llm.generate(["Hello, my name is"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                              ignore_eos=True), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct samples
    [again] = llm.generate(["Hello, my name is"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                                ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_string(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [ref] = llm.generate(["The capital"], greedy, use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop
    [out] = llm.generate(["The capital"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                         stop=[stop]), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]
    assert _usage(llm) == 0.0


def test_n_siblings_share_prompt_blocks(llm):
    prompt = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 2
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    full_blocks = (n_prompt - 1) // 16
    assert full_blocks >= 1
    hits_before = llm.llm_engine.get_stats()["prefix_cache_hits"]
    [out] = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs) == 3
    # Siblings 1 and 2 read the first child's full prompt blocks from the prefix cache.
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - hits_before >= 2 * full_blocks * 16
    assert _usage(llm) == 0.0


def test_duplicate_client_ids_are_both_served_and_prompt_tokens_counted_at_prefill(llm):
    engine = llm.llm_engine
    before = engine.get_stats()["prompt_tokens_total"]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = engine.add_request("dup", [5, 6, 7, 8], params)
    second = engine.add_request("dup", [5, 6], params)
    assert first != second and first.startswith("dup-") and second.startswith("dup-")
    assert engine.get_stats()["prompt_tokens_total"] == before  # nothing prefilled yet
    done = {}
    while engine.has_unfinished_requests():
        for internal_id, out in engine.step_routed():
            assert out.request_id == "dup"  # the client sees its own id
            if out.finished:
                done[internal_id] = out
    assert set(done) == {first, second}
    assert [len(done[i].prompt_token_ids) for i in (first, second)] == [4, 2]
    assert engine.get_stats()["prompt_tokens_total"] == before + 6


def test_hostile_fields_are_refused_or_neutralised_and_the_engine_goes_on(llm):
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="request_id is not valid UTF-8"):
        engine.add_request("id-\ud800", [5, 6], greedy)
    with pytest.raises(ValueError, match="prompt is not valid UTF-8"):
        llm.generate(["fine", "bad \ud800"], greedy, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    params.temperature = float("inf")  # set after construction: admission checks again
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        llm.generate(["hi"], params, use_tqdm=False)
    assert not engine.has_unfinished_requests() and _usage(llm) == 0.0
    # top_k past int64 clamps to the vocabulary instead of overflowing the sampler's arrays.
    [out] = llm.generate(["hi"], SamplingParams(temperature=1.0, top_k=2**64, seed=3, max_tokens=4,
                                                ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_chat_passes_tools_to_the_template_and_takes_a_constraint(llm):
    from jaxlm.structured_output import StructuredOutputsParams

    template = ("{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(choice=["sunny", "rain"]))
    [out] = llm.chat([{"role": "user", "content": "Weather?"}], params, use_tqdm=False,
                     chat_template=template, tools=tools)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "[get_weather]Weather?"
    assert out.outputs[0].text in ("sunny", "rain") and out.outputs[0].finish_reason == "stop"


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="priority=1 needs --scheduling-policy priority"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[0, 1], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    [out] = llm.generate(["a"], SamplingParams(max_tokens=2, ignore_eos=True), priority=[0], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_lora_request_needs_enable_lora(llm):
    from jaxlm import LoRARequest

    with pytest.raises(ValueError, match="LoRA adapters are not enabled: start the engine with enable_lora=True"):
        llm.generate("a", SamplingParams(max_tokens=2), lora_request=LoRARequest("x", 1, "/nowhere"))
    assert not llm.llm_engine.has_unfinished_requests()


def test_image_to_a_text_only_model_fails_alone(llm):
    from PIL import Image

    image = Image.new("RGB", (8, 8))
    with pytest.raises(ValueError, match="does not support multimodal inputs .multi_modal_data.: it is a text-only"):
        llm.generate({"prompt": "a <image>", "multi_modal_data": {"image": image}}, SamplingParams(max_tokens=2))
    url = "data:image/png;base64,iVBORw0KGgo="
    with pytest.raises(ValueError, match="image_url content parts need a multimodal model: this model is text-only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                 SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
    [out] = llm.generate(["a"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
