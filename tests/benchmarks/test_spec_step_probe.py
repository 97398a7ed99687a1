"""jaxlm/benchmarks/spec_step_probe.py: each scheduled step is counted once, by kind (verify when a request
verifies drafts, one-token decode, else prefill), with the wall time of the engine-core step that
ran it; empty schedules are not steps; the summary's share and tokens per step follow."""

import types

from jaxlm.benchmarks import spec_step_probe as probe_mod


def _so(tokens: dict, drafts: dict | None = None):
    return types.SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                                 scheduled_spec_decode_tokens=drafts or {})


class _Core:
    """Two schedules per step (as the async driver does) on the second step."""

    def __init__(self, plan):
        self.plan = list(plan)
        self.scheduler = types.SimpleNamespace(schedule=self._schedule)

    def _schedule(self):
        return self.plan.pop(0)

    def step(self):
        n = 2 if len(self.plan) == 3 else 1
        return [self.scheduler.schedule() for _ in range(n)]


def test_steps_are_counted_by_kind_once_each():
    core = _Core([_so({"a": 7}), _so({"a": 1}), _so({}), _so({"a": 4}, {"a": [5, 6, 7]}), _so({"a": 1, "b": 3})])
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(_inproc_core=lambda: core))
    probe = probe_mod.StepProbe(llm)
    for _ in range(4):
        core.step()
    steps = probe.take()
    assert [(k, t, d) for k, t, d, _ in steps] == [
        ("prefill", 7, 0), ("decode", 1, 0), ("verify", 4, 3), ("prefill", 4, 0)]
    assert probe.take() == []
    s = probe_mod.summarize(steps, num_out_tokens=8)
    assert s["counts"] == {"decode": 1, "verify": 1, "prefill": 2}
    assert s["verify_share"] == 0.25 and s["tokens_per_step"] == 2.0
    assert "verify 1 = 25.0%" in probe_mod.describe(s)
