"""Orbax round trip: a loaded model saved with save_orbax() restores identically (format auto or explicit)."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
import jax
from flax import nnx

from loader_helpers import load
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import MissingWeightsError, NoWeightsError, resolve_model_config, save_orbax
from jaxlm.model_loader.formats import ORBAX_MARKER


def _params(model) -> dict:
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def orbax_dir(tiny_llama_dir, tmp_path_factory):
    model = load(tiny_llama_dir)
    mc = resolve_model_config(ModelConfig(model=tiny_llama_dir), LoadConfig())
    out = str(tmp_path_factory.mktemp("orbax") / "ckpt")
    save_orbax(model, out, mc.hf_config)
    return out, _params(model)


@pytest.mark.parametrize("load_format", ["auto", "orbax"])
def test_round_trip_identical(orbax_dir, load_format):
    out, want = orbax_dir
    assert os.path.isfile(os.path.join(out, ORBAX_MARKER)) and os.path.isfile(os.path.join(out, "config.json"))
    mc = resolve_model_config(ModelConfig(model=out), LoadConfig(load_format=load_format))
    assert mc.hf_config.model_type == "llama"
    model = load(out, load_format=load_format)
    got = _params(model)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    leaf = model.model.layers[0].mlp.up_proj.weight[...]
    assert isinstance(leaf, jax.Array) and leaf.sharding.device_set == {jax.devices()[0]}


def test_restore_in_other_dtype(orbax_dir):
    import ml_dtypes

    out, want = orbax_dir
    model = load(out, dtype="bfloat16")
    got = _params(model)
    k = "model.layers.1.self_attn.q_proj.weight"
    assert got[k].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got[k], want[k].astype(ml_dtypes.bfloat16))


def test_missing_param_and_not_orbax(orbax_dir, tmp_path, tiny_llama_dir):
    out, _ = orbax_dir
    with pytest.raises(NoWeightsError, match=r"not a jaxlm orbax checkpoint"):
        load(tiny_llama_dir, load_format="orbax")
    # a checkpoint of a model with fewer layers misses the rest
    import json

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MissingWeightsError, match=rf"^{re.escape(str(bad))}: missing \d+ weight\(s\): model\.layers\.2\."):
        load(str(bad))


_MESH_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np
from jax.sharding import Mesh
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.model_loader import get_model, resolve_model_config, save_orbax
src, dst = sys.argv[1], sys.argv[2]
mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "model"))
mc = resolve_model_config(ModelConfig(model=src), LoadConfig())
m = get_model(mc, LoadConfig(), attn_backend=None, mesh=mesh)
save_orbax(m, dst, mc.hf_config)
m2 = get_model(resolve_model_config(ModelConfig(model=dst), LoadConfig()), LoadConfig(), attn_backend=None, mesh=mesh)
for a, b in ((m.model.layers[0].self_attn.q_proj.weight[...], m2.model.layers[0].self_attn.q_proj.weight[...]),
             (m.model.layers[1].mlp.down_proj.weight[...], m2.model.layers[1].mlp.down_proj.weight[...])):
    assert b.sharding == a.sharding and len(b.sharding.device_set) == 2, (a.sharding, b.sharding)
    assert np.array_equal(np.asarray(a), np.asarray(b))
print("MESH_OK", m2.model.layers[0].self_attn.q_proj.weight[...].sharding.spec)
"""


def test_orbax_restores_into_mesh_sharding(tiny_llama_dir, tmp_path):
    """Restore targets each Param's NamedSharding on the mesh (2 fake CPU devices, fresh process)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, tiny_llama_dir, str(tmp_path / "ckpt")],
                         capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root}, timeout=300)
    assert "MESH_OK" in out.stdout, out.stderr[-3000:]


_TP_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np
from flax import nnx
from jaxlm.config import LoadConfig, ModelConfig
from jaxlm.executor.mesh_executor import make_mesh
from jaxlm.model_loader import get_model, resolve_model_config, save_orbax
from jaxlm.models.utils import to_hf_layout
from tests.helpers import tiny_models as tm
src = tm.make_tiny_model("llama", sys.argv[1] + "/src", vocab_size=322)  # 2 KV heads; 322 rows pad at TP=4

def load(path, tp):
    return get_model(resolve_model_config(ModelConfig(model=path), LoadConfig()), LoadConfig(),
                     attn_backend=None, mesh=make_mesh(tp))

def hf_view(model):
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, p)): to_hf_layout(v, np.asarray(v.get_value())) for p, v in flat}

saved_at = {4: sys.argv[1] + "/tp4", 1: sys.argv[1] + "/tp1"}
for tp, path in saved_at.items():
    save_orbax(load(src, tp), path, resolve_model_config(ModelConfig(model=src), LoadConfig()).hf_config)
for tp in (1, 2, 4):
    want = load(src, tp)
    for saved_tp, path in saved_at.items():
        got = load(path, tp)
        for (k, a), b in zip(hf_view(want).items(), hf_view(got).values()):
            assert np.array_equal(a, b), (tp, saved_tp, k)
        k = nnx.to_flat_state(nnx.state(got, nnx.Param))
        shapes = {".".join(map(str, p)): v.get_value().shape for p, v in k}
        want_shapes = {".".join(map(str, p)): v.get_value().shape
                       for p, v in nnx.to_flat_state(nnx.state(want, nnx.Param))}
        assert shapes == want_shapes, (tp, saved_tp)
print("TP_OK")
"""


def test_orbax_checkpoint_restores_at_any_tensor_parallel_size(tmp_path):
    """Saved at TP=4 (KV heads repeated, vocabulary padded) or TP=1, restored at TP=1/2/4: the
    same weights as loading the safetensors at that TP (8 fake CPU devices, fresh process)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, cwd=root, env=env, timeout=300)
    assert "TP_OK" in out.stdout, out.stderr[-3000:]
