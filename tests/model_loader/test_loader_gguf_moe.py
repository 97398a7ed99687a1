"""GGUF mixture-of-experts files (llama.cpp's stacked ``ffn_*_exps``): Mixtral (``llama``),
Qwen2-MoE and Qwen3-MoE load into the same Params as their safetensors checkpoints."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import transformers
from flax import nnx

from gguf_writer import write_gguf
from loader_helpers import load
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import resolve_model_config
from tests.helpers import tiny_models as tm

_Q = gguf.GGMLQuantizationType
# family -> GGUF architecture llama.cpp writes it under
ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("family", list(ARCHS))
@pytest.mark.parametrize("quant", [_Q.F32, _Q.Q8_0], ids=lambda q: q.name)
def test_moe_gguf_loads_the_checkpoint_weights(family, quant, tmp_path):
    # Qwen2-MoE with a dense layer between sparse ones (it has no router in the file).
    over = dict(mlp_only_layers=[0]) if family == "qwen2_moe" else {}
    src = tm.make_tiny_model(family, tmp_path / family, **over)
    cfg = transformers.AutoConfig.from_pretrained(src)
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(src, path, cfg, quant, arch=ARCHS[family])
    got_cfg = resolve_model_config(ModelConfig(model=path), LoadConfig()).hf_config
    assert got_cfg.architectures == cfg.architectures
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "head_dim"):
        if getattr(cfg, key, None) is not None:
            assert getattr(got_cfg, key) == getattr(cfg, key), key
    if family != "mixtral":
        sparse = [i for i in range(cfg.num_hidden_layers)
                  if i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0]
        assert [i for i in range(cfg.num_hidden_layers) if i not in got_cfg.mlp_only_layers] == sparse
    ours, ref = _params(load(path, quantization="none")), _params(load(src))
    assert ours.keys() == ref.keys()
    for name, want in ref.items():
        tol = 0.0 if quant == _Q.F32 or want.ndim == 1 else np.abs(want).max() / 127
        np.testing.assert_allclose(ours[name], want, atol=tol, rtol=0, err_msg=name)
