"""OPT and GPT-2 logits and greedy tokens equal transformers' (float32)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import tiny_models as tm
from tests.models._parity import TOL, run_parity


def _prompts(seed: int = 1, lens=(5, 11, 17)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lens]


CASES = {
    "opt_pre_ln_tied": (tm.make_tiny_opt, {}, None),
    "opt_project_in_out": (tm.make_tiny_opt, dict(word_embed_proj_dim=32), None),
    "opt_post_ln_untied": (tm.make_tiny_opt, dict(do_layer_norm_before=False, tie_word_embeddings=False), 4),
    "gpt2_tied": (tm.make_tiny_gpt2, {}, None),
    "gpt2_untied_chunked": (tm.make_tiny_gpt2, dict(tie_word_embeddings=False), 4),
    "gpt2_scale_by_layer_idx": (tm.make_tiny_gpt2, dict(scale_attn_by_inverse_layer_idx=True), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_parity(case: str, tmp_path) -> None:
    maker, overrides, chunk = CASES[case]
    path = maker(tmp_path / case, **overrides)
    res = run_parity(path, _prompts(), steps=32, chunk=chunk)
    print(f"{case}: prefill max|diff| {res.prefill_max_diff:.2e}, decode {res.decode_max_diff:.2e}")
    assert res.prefill_max_diff < TOL, res.prefill_max_diff
    assert res.decode_max_diff < TOL, res.decode_max_diff
    assert res.tokens_equal, f"ours {res.ours}\nhf   {res.ref}"
