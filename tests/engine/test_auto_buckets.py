"""--token-buckets auto --workload W: the engine derives its buckets before compiling anything."""

from __future__ import annotations

import pytest

from jaxlm import LLM, SamplingParams
from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.serve.cli_args import make_arg_parser
from tests.helpers.tiny_models import make_tiny_engine_model

WORKLOAD = "synthetic:num=12,prompt=40-60,output=2-6,seed=1"


def test_cli_parses_auto_and_workload():
    args = make_arg_parser().parse_args(["--token-buckets", "auto", "--workload", WORKLOAD, "--max-programs", "9"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.token_buckets, engine_args.workload, engine_args.max_programs) == ("auto", WORKLOAD, 9)
    assert make_arg_parser().parse_args(["--token-buckets", "16,64"]).token_buckets == [16, 64]


def test_llm_with_auto_buckets(tmp_path):
    model = make_tiny_engine_model("llama", tmp_path / "m")
    llm = LLM(model=model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
              token_buckets="auto", workload=WORKLOAD, max_programs=12)
    runner = llm.llm_engine.get_model_runner()
    comp = llm.llm_engine.engine_config.compilation_config
    assert comp.token_buckets == runner.token_buckets and comp.seq_buckets == runner.seq_buckets
    assert runner.num_programs <= 12
    # Prompts of 40-60 tokens under a 64-token budget: the derived buckets are not powers of two.
    assert any(t & (t - 1) for t in runner.token_buckets), runner.token_buckets
    out = llm.generate([[5] * 50], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert runner.num_compiles_after_warmup == 0


def test_auto_without_workload_is_refused(tmp_path):
    model = make_tiny_engine_model("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="needs --workload"):
        LLM(model=model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, token_buckets="auto")
