"""speculative_config: vLLM's fields and defaults, through LLM(...) and --speculative-config; every
bad field or method refused by name, before any model is loaded."""

from __future__ import annotations

import math

import pytest

from jaxlm.config import SpeculativeConfig
from jaxlm.config.speculative import max_sampled_rows
from jaxlm.engine.arg_utils import EngineArgs
from jaxlm.serve.cli_args import make_arg_parser


def _cli(*argv: str):
    return EngineArgs.from_cli_args(make_arg_parser().parse_args(list(argv))).create_engine_config()


def test_vllm_defaults():
    ngram = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)  # vLLM's
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    only_min = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    # No method: inferred from "model", as vLLM does.
    assert SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 1}).method == "ngram"
    draft = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 3,
                                         "draft_tensor_parallel_size": 1, "disable_by_batch_size": 8})
    assert (draft.method, draft.uses_draft_model, draft.disable_by_batch_size) == ("draft_model", True, 8)
    assert SpeculativeConfig.from_dict(None) is None and SpeculativeConfig.from_dict({}) is None


def test_through_llm_kwargs_and_the_cli_flag():
    from jaxlm.entrypoints.llm import _engine_args

    cfg = _engine_args("m", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}}
                       ).create_engine_config()
    spec = cfg.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 2, 4)
    cfg = _cli("--speculative-config", '{"method": "draft_model", "model": "d", "num_speculative_tokens": 5}')
    assert (cfg.speculative_config.method, cfg.speculative_config.model) == ("draft_model", "d")
    assert _cli().speculative_config is None
    # A SpeculativeConfig object works too (vLLM's LLM takes either).
    obj = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert _engine_args(None, {"speculative_config": obj}).create_engine_config().speculative_config is obj


@pytest.mark.parametrize("value,needle", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method='eagle' is not supported yet"),
    ({"method": "eagle3", "num_speculative_tokens": 3, "model": "x"}, "method='eagle3' is not supported yet"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "not supported yet"),
    ({"method": "telepathy", "num_speculative_tokens": 3}, "Unknown speculative_config.method 'telepathy'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "Unknown speculative_config field(s): 'lookahead'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 3}, "needs a method"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": 7}, "model must be a string"),
    ({"method": ["ngram"], "num_speculative_tokens": 3}, "method must be a string"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
    ({"method": "ngram", "num_speculative_tokens": -3}, "must be a positive integer, got -3"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be a positive integer, got 2.5"),
    ({"method": "ngram", "num_speculative_tokens": math.nan}, "must be a positive integer, got nan"),
    ({"method": "ngram", "num_speculative_tokens": math.inf}, "must be a positive integer, got inf"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "must be a positive integer, got '4'"),
    ({"method": "ngram", "num_speculative_tokens": True}, "must be a positive integer, got True"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "x" * 10**6}, "prompt_lookup_max must be"),
])
def test_bad_configs_are_refused_naming_the_field(value, needle):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.from_dict(value)
    assert needle in str(err.value)


def test_refused_through_the_entrypoints_before_loading(capsys):
    from jaxlm import LLM

    with pytest.raises(ValueError, match="method='eagle' is not supported yet"):
        LLM(model="/nonexistent", speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="must be a JSON object"):
        LLM(model="/nonexistent", speculative_config="ngram")
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--speculative-config", "[1, 2]"])
    assert "expected a JSON object" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Unknown speculative_config field"):
        _cli("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "k": 3}')


def test_limits_against_the_engine():
    huge = SpeculativeConfig(method="ngram", num_speculative_tokens=10**30)
    with pytest.raises(ValueError, match="must be below max_num_batched_tokens=512"):
        huge.check_against(512, 2048, 1)
    draft = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2, draft_tensor_parallel_size=3)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=3 must be 1 or the target's"):
        draft.check_against(512, 2048, 2)
    SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2,
                      draft_tensor_parallel_size=1).check_against(512, 2048, 2)
    # The sampler's rows: one per request, or 1 + k per speculating request within the budget.
    assert max_sampled_rows(None, 64, 512) == 64
    assert max_sampled_rows(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 64, 512) == 320
    assert max_sampled_rows(SpeculativeConfig(method="ngram", num_speculative_tokens=15), 64, 512) == 512
