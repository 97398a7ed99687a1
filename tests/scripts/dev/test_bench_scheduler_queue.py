"""scripts/dev/bench_scheduler_queue.py runs against the scheduler as it stands (both policies)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_bench_scheduler_queue_runs(capsys):
    spec = importlib.util.spec_from_file_location("bench_scheduler_queue",
                                                  os.path.join(ROOT, "scripts", "dev", "bench_scheduler_queue.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for policy in ("fcfs", "priority"):
        assert bench.step_cost_us(policy, 50, 10) > 0
