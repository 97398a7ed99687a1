"""Stop checks in update_from_output: eos, stop ids, min_tokens, max_tokens, max_model_len."""

from core_sim import FakeRunner, assert_no_leak, make_request, make_scheduler, run_engine

from jaxlm.core.outputs import FinishReason

EOS = 2
PROMPT = [11, 12, 13, 14, 15]


def _run(script: list[int], eos_token_id=EOS, max_model_len=256, **params):
    """Run one request whose i-th sampled token is script[i] (then 500, 501, ...)."""

    def token_fn(rid: str, pos: int) -> int:
        i = pos - len(PROMPT)
        return script[i] if i < len(script) else 500 + i

    sched = make_scheduler(100, max_model_len=max_model_len)
    sched.add_request(make_request("r", PROMPT, eos_token_id=eos_token_id, **params))
    res = run_engine(sched, FakeRunner(4, token_fn=token_fn))
    assert_no_leak(sched)
    return res.outputs["r"], res.finish["r"]


def test_eos_stops_and_is_kept():
    out, fin = _run([7, 8, EOS, 9], max_tokens=10)
    assert out == [7, 8, EOS]
    assert fin.finish_reason == FinishReason.STOP and fin.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    out, fin = _run([7, EOS, EOS], max_tokens=5, ignore_eos=True)
    assert out == [7, EOS, EOS, 503, 504] and fin.finish_reason == FinishReason.LENGTH


def test_ignore_eos_even_when_eos_is_in_all_stop_token_ids():
    def run():
        def token_fn(rid, pos):
            return EOS

        sched = make_scheduler(100)
        req = make_request("r", PROMPT, eos_token_id=EOS, max_tokens=3, ignore_eos=True)
        req.sampling_params.all_stop_token_ids = {EOS, 77}
        sched.add_request(req)
        return run_engine(sched, FakeRunner(4, token_fn=token_fn))

    res = run()
    assert res.outputs["r"] == [EOS] * 3 and res.finish["r"].finish_reason == FinishReason.LENGTH


def test_stop_token_ids_set_stop_reason():
    out, fin = _run([7, 42, 9], max_tokens=10, stop_token_ids=[42])
    assert out == [7, 42]
    assert fin.finish_reason == FinishReason.STOP and fin.stop_reason == 42


def test_all_stop_token_ids_only_mask_and_never_end_a_request():
    # vLLM's meaning: all_stop_token_ids are held back under min_tokens; only the resolved
    # stop_token_ids (and eos) end a request. (With ignore_eos the InputProcessor leaves a
    # generation-config eos out of stop_token_ids but keeps it in all_stop_token_ids.)
    def token_fn(rid, pos):
        return 43 if pos - len(PROMPT) == 3 else 7

    sched = make_scheduler(100)
    req = make_request("r", PROMPT, eos_token_id=EOS, max_tokens=6)
    req.sampling_params.all_stop_token_ids = {43}
    sched.add_request(req)
    res = run_engine(sched, FakeRunner(4, token_fn=token_fn))
    assert res.outputs["r"] == [7, 7, 7, 43, 7, 7] and res.finish["r"].finish_reason == FinishReason.LENGTH


def test_min_tokens_holds_back_eos_and_stop_ids():
    out, fin = _run([EOS, 42, 7, EOS, 42], max_tokens=10, min_tokens=4, stop_token_ids=[42])
    assert out == [EOS, 42, 7, EOS] and fin.finish_reason == FinishReason.STOP
    out, fin = _run([EOS, 42, 7, 8, 42], max_tokens=10, min_tokens=4, stop_token_ids=[42])
    assert out == [EOS, 42, 7, 8, 42] and fin.stop_reason == 42


def test_max_tokens_is_length():
    out, fin = _run([7, 8, 9, 10], max_tokens=3)
    assert out == [7, 8, 9] and fin.finish_reason == FinishReason.LENGTH and fin.stop_reason is None


def test_eos_on_the_last_allowed_token_is_stop():
    out, fin = _run([7, 8, EOS], max_tokens=3)
    assert out == [7, 8, EOS] and fin.finish_reason == FinishReason.STOP


def test_default_max_tokens_stops_at_max_model_len():
    out, fin = _run([], max_model_len=len(PROMPT) + 4, max_tokens=None, ignore_eos=True)
    assert len(out) == 4 and fin.finish_reason == FinishReason.LENGTH


def test_no_eos_token_id():
    out, fin = _run([EOS, 7], eos_token_id=None, max_tokens=2)
    assert out == [EOS, 7] and fin.finish_reason == FinishReason.LENGTH
