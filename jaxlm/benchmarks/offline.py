"""What the offline benchmarks (`jaxlm bench throughput|latency`, scripts/bench.py's engine
processes) share: the engine built from `jaxlm serve`'s engine flags, and finished requests'
engine timestamps turned into the per-request timings of jaxlm/benchmarks/metrics.py."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from jaxlm.benchmarks.metrics import RequestOutcome


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Every engine argument as parsed from the flags EngineArgs.add_cli_args added."""
    from jaxlm.engine.arg_utils import EngineArgs

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}


def load_tokenizer(args: argparse.Namespace) -> Any:
    """The model's tokenizer, before the engine is built (so a bad dataset fails before compiling)."""
    from jaxlm.config import ModelConfig
    from jaxlm.model_loader.tokenizer import get_tokenizer

    return get_tokenizer(ModelConfig(model=args.model, tokenizer=args.tokenizer, revision=args.revision))


def outcomes_from_outputs(outputs: list[Any], t0: float) -> list[RequestOutcome]:
    """RequestOutcomes from finished RequestOutputs (time.time() stamps; t0 on the same clock).
    The engine keeps no per-token times, so no ITL: TTFT, TPOT and E2EL only."""
    out = []
    for o in outputs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        ok = m is not None and m.first_token_ts is not None and m.last_token_ts is not None
        out.append(RequestOutcome(
            success=ok, prompt_len=len(o.prompt_token_ids), output_tokens=n,
            start_time=(m.arrival_time - t0) if ok else 0.0,
            ttft=(m.first_token_ts - m.arrival_time) if ok else 0.0,
            latency=(m.last_token_ts - m.arrival_time) if ok else 0.0,
            error="" if ok else "no timestamps"))
    return out
