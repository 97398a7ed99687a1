"""Per-step accounting for jaxlm/benchmarks/spec_decode.py: how many engine steps verified drafts, tokens
per step, and the wall time of each kind of step.

Acceptance alone misleads: it only counts the steps that had drafts. Here every step the
scheduler hands to the runner is recorded (its scheduled tokens and drafts) with the wall time
of the engine-core step that ran it; a step is "verify" when some request verifies drafts,
"decode" when every request is scheduled for one token, else "prefill" (prompt tokens).
Under async scheduling an engine-core step also finishes the previous step, so its per-kind
times are only indicative; the spec engines' verify steps run synchronously.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


class StepProbe:
    """Wraps one in-process engine core's schedule() and step() (instance attributes only)."""

    def __init__(self, llm: Any) -> None:
        core = llm.llm_engine._inproc_core()
        self.steps: list[tuple[str, int, int, float]] = []  # kind, tokens, draft tokens, wall s
        self._pending: list[tuple[str, int, int]] = []
        schedule, step = core.scheduler.schedule, core.step

        def probed_schedule():
            so = schedule()
            if so.total_num_scheduled_tokens:
                drafts = sum(map(len, so.scheduled_spec_decode_tokens.values()))
                n_reqs = len(so.num_scheduled_tokens)
                kind = ("verify" if drafts else
                        "decode" if so.total_num_scheduled_tokens == n_reqs else "prefill")
                self._pending.append((kind, so.total_num_scheduled_tokens, drafts))
            return so

        def probed_step():
            t0 = time.perf_counter()
            out = step()
            wall = time.perf_counter() - t0
            for i, (kind, tokens, drafts) in enumerate(self._pending):
                self.steps.append((kind, tokens, drafts, wall if i == 0 else 0.0))
            self._pending.clear()
            return out

        core.scheduler.schedule = probed_schedule
        core.step = probed_step

    def take(self) -> list[tuple[str, int, int, float]]:
        steps, self.steps = self.steps, []
        return steps


def summarize(steps: list[tuple[str, int, int, float]], num_out_tokens: int) -> dict:
    """Share of steps that verify drafts, output tokens per step, median wall time by kind (ms)."""
    n = max(len(steps), 1)
    kinds = {k: [s[3] for s in steps if s[0] == k and s[3] > 0] for k in ("decode", "verify", "prefill")}
    counts = {k: sum(1 for s in steps if s[0] == k) for k in kinds}
    return {"steps": len(steps), "verify_share": counts["verify"] / n, "tokens_per_step": num_out_tokens / n,
            "counts": counts,
            "median_ms": {k: 1e3 * statistics.median(v) if v else None for k, v in kinds.items()}}


def describe(s: dict) -> str:
    ms = s["median_ms"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return (f"steps {s['steps']} (verify {s['counts']['verify']} = {s['verify_share']:.1%}, decode "
            f"{s['counts']['decode']}, prefill {s['counts']['prefill']})  out tokens/step {s['tokens_per_step']:.2f}"
            f"  median ms decode/verify/prefill {fmt(ms['decode'])}/{fmt(ms['verify'])}/{fmt(ms['prefill'])}")
